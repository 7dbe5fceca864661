"""Captioning a dataset folder: each image gets the caption file Tempera trains with
(`<image stem><caption extension>`, `.txt` by default), from a captioner of the table
`CAPTIONERS`, chosen by name or through a preset of `PRESETS`.

    settings = preset_settings("small-card", prefix="sks")
    report = caption_folder(Path("images"), settings, JobHooks(progress=...), stop_event)

An image that already has a caption is treated as `settings.existing` says: "skip" leaves it,
"extend" adds the new caption after it (a tagger adds only tags not there yet), "replace" writes
the new one. Whatever is changed is first copied, byte for byte, into the folder's
`.tempera-caption-backup/<date-time of the job>-caption-job/` (hidden, so no scan trains on
it; the caption editor's find-and-replace backs up into the same folder, each run its own
subfolder), so nothing is ever lost. Existing captions are read as the dataset scan reads them
(UTF-8, a BOM allowed), and also as UTF-16 or UTF-32 with a BOM (Windows Notepad's "Unicode");
a caption file in another encoding is never rewritten by "extend": its image is left alone
and named in the report. Captions are always written as UTF-8, which training reads.

Everything else — batches, Stop, the re-run that continues, the lock, progress, bad images,
loading the model only for the job and releasing it — is modules/data/prep/job.py's.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.data.caption_edit import decode_caption
from modules.data.captions import split_tags
from modules.data.errors import DatasetError
from modules.data.folders import normalize_caption_extension
from modules.data.prep.captioners import (FLORENCE_CAPTION_TASKS, Caption, Florence2Captioner,
                                          QwenVLCaptioner, RunOptions, WDTagger)
from modules.data.prep.hub import model_folder
from modules.data.prep.fields import option
from modules.data.prep.job import (BatchModel, FolderJob, JobHooks, JobRefused, JobReport,
                                   run_job)
from modules.util.atomic import atomic_write_bytes, atomic_write_text

BACKUP_FOLDER = ".tempera-caption-backup"
EXISTING_CHOICES = ("skip", "extend", "replace")
DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class CaptionerKind:
    """One row of the captioner table: the class that runs it and what it needs."""
    label: str
    make: Callable[[Path, RunOptions], BatchModel]
    files: tuple[str, ...] | None   # the files fetched from a repository (None: all)
    tags: bool                      # writes booru tags (extend adds only new tags)


CAPTIONERS: dict[str, CaptionerKind] = {
    "florence2": CaptionerKind("Florence-2", Florence2Captioner, None, tags=False),
    "qwen-vl": CaptionerKind("Qwen-VL", QwenVLCaptioner, None, tags=False),
    "wd-tagger": CaptionerKind("WD v3 tagger", WDTagger, ("model.onnx", "selected_tags.csv"),
                               tags=True),
}

QWEN_PROMPT = ("Describe this image in one detailed paragraph for training an image model: the "
               "main subject and what it looks like, what it does, the setting, the lighting, the "
               "composition and the style or medium. Write only the description.")


@dataclass(frozen=True)
class CaptionSettings:
    """Everything a caption job does; each field's help is the command line's and the window's."""
    captioner: str = option("florence2", "which kind of captioner", choices=tuple(CAPTIONERS))
    model: str = option("florence-community/Florence-2-base",
                         "a Hugging Face repository id or a folder of weights")
    prompt: str = option("<DETAILED_CAPTION>", "Florence-2: a caption task token "
                          f"({', '.join(FLORENCE_CAPTION_TASKS)}); Qwen-VL: the instruction")
    max_tokens: int = option(160, "the longest caption, in tokens (natural-language captioners)")
    prefix: str = option("", "a trigger word or prefix written before every caption")
    existing: str = option("skip", "an image that has a caption: skip it, extend the caption, "
                            "or replace it (the old file is kept in .tempera-caption-backup/)",
                            choices=EXISTING_CHOICES)
    caption_extension: str = option(".txt", "the caption files' extension (the dataset's "
                                     "data.caption_extension)")
    batch_size: int = option(4, "images per batch")
    device: str = option("auto", "where the model runs (auto: the GPU when there is one)",
                          choices=DEVICE_CHOICES)
    general_threshold: float = option(0.35, "tagger: the score a general tag needs")
    character_threshold: float = option(0.85, "tagger: the score a character tag needs")
    exclude_tags: tuple[str, ...] = option((), "tagger: tags never written (comma-separated)")
    keep_separator: bool = option(False, "tagger: write 'characters ||| general tags' so tag "
                                   "shuffling keeps the characters first (docs/datasets.md)")
    recursive: bool = option(False, "caption the images in subfolders too")
    offline: bool = option(False, "never download: use only the Hugging Face cache or a folder")


@dataclass(frozen=True)
class Preset:
    """A preset: the captioner, its model and the options that suit them."""
    summary: str
    values: dict[str, Any]


PRESETS: dict[str, Preset] = {
    "small-card": Preset("Florence-2 base: one-sentence-to-paragraph captions; 2 GB of GPU "
                         "memory, or the CPU", {
                             "captioner": "florence2", "prompt": "<DETAILED_CAPTION>",
                             "model": "florence-community/Florence-2-base", "max_tokens": 160,
                             "batch_size": 8}),
    "detailed": Preset("Qwen3-VL 4B Instruct: detailed paragraphs; about 10 GB of GPU memory", {
        "captioner": "qwen-vl", "model": "Qwen/Qwen3-VL-4B-Instruct", "prompt": QWEN_PROMPT,
        "max_tokens": 300, "batch_size": 4}),
    "tags": Preset("WD EVA02-Large tagger v3: booru tags (anime and illustration); runs well "
                   "on the CPU", {
                       "captioner": "wd-tagger", "model": "SmilingWolf/wd-eva02-large-tagger-v3",
                       "batch_size": 8}),
}


def preset_settings(name: str | None, **changes: Any) -> CaptionSettings:
    """The preset's settings with `changes` on top (raises KeyError for an unknown preset).
    Without a preset, a `captioner` change brings the model and options of the first preset
    of that captioner (a tagger never starts from Florence-2's model)."""
    if name is None:
        name = next((n for n, p in PRESETS.items()
                     if p.values["captioner"] == changes.get("captioner")), None)
    base = PRESETS[name].values if name is not None else {}
    return dataclasses.replace(CaptionSettings(), **{**base, **changes})


def validate(settings: CaptionSettings) -> list[str]:
    """Every problem with `settings`, each naming the option; empty when they are usable."""
    problems = []
    for f in dataclasses.fields(settings):
        choices = f.metadata.get("choices")
        if choices and getattr(settings, f.name) not in choices:
            problems.append(f"{f.name}: expected one of {', '.join(choices)}, got "
                            f"{getattr(settings, f.name)!r}")
    if settings.captioner == "florence2" and settings.prompt not in FLORENCE_CAPTION_TASKS:
        problems.append(f"prompt: Florence-2 captions with a task token "
                        f"({', '.join(FLORENCE_CAPTION_TASKS)}), got {settings.prompt!r}")
    if settings.captioner == "qwen-vl" and not settings.prompt.strip():
        problems.append("prompt: Qwen-VL needs an instruction")
    if settings.max_tokens < 1 or settings.batch_size < 1:
        problems.append("max_tokens and batch_size must be at least 1, got "
                        f"{settings.max_tokens} and {settings.batch_size}")
    for name in ("general_threshold", "character_threshold"):
        if not 0.0 <= getattr(settings, name) <= 1.0:
            problems.append(f"{name}: a score between 0 and 1, got {getattr(settings, name)}")
    try:
        normalize_caption_extension(settings.caption_extension)
    except DatasetError as exc:
        problems.append(f"caption_extension: {exc}")
    return problems


def pick_device(device: str) -> str:
    """"cuda" for "auto" when a GPU is there, else "cpu"; "cuda" without one is refused."""
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        raise JobRefused("device cuda was asked for but torch sees no GPU: use --device cpu")
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) \
        else "cpu"


def read_caption(path: Path) -> str:
    """A caption file's text as the dataset scan reads it (UTF-8, a BOM allowed), or UTF-16 /
    UTF-32 with a BOM; raises UnicodeDecodeError for any other encoding."""
    return decode_caption(path.read_bytes())[0].strip()


def extended(old: str, new: Caption, tags: bool) -> str:
    """`old` followed by `new`; for tags only those `old` lacks (the prefix is in `old`)."""
    if not old:
        return new.text
    if not tags:
        return f"{old.rstrip(' ,.')}. {new.text}" if old.rstrip()[-1:] not in ".!?" \
            else f"{old} {new.text}"
    have = {tag.lower() for tag in split_tags(old.replace("|||", ","))}
    fresh = [tag for tag in split_tags(new.text.replace("|||", ",")) if tag.lower() not in have]
    return ", ".join([old.rstrip(" ,"), *fresh]) if fresh else old


class CaptionWriter:
    """Writes one image's caption file as `settings.existing` says, the old file backed up."""

    def __init__(self, folder: Path, settings: CaptionSettings) -> None:
        self.folder, self.settings = folder, settings
        self.extension = normalize_caption_extension(settings.caption_extension)
        self.tags = CAPTIONERS[settings.captioner].tags
        # one folder per job, never shared: two jobs started within a second must not back up
        # into one folder (the second would overwrite the first's copy of the user's caption)
        stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{time.time_ns() % 1_000_000_000:09d}"
        self.backup_root = folder / BACKUP_FOLDER / f"{stamp}-caption-job"

    def caption_path(self, image: Path) -> Path:
        return image.with_name(image.stem + self.extension)

    def needs_work(self, image: Path) -> str | None:
        """None to caption `image`; else why it is left alone."""
        path = self.caption_path(image)
        if not path.is_file():
            return None
        if self.settings.existing == "skip":
            try:
                has_text = bool(read_caption(path))
            except UnicodeDecodeError:
                has_text = True  # text it cannot read is still a caption the user wrote
            return f"has a caption ({self.extension})" if has_text else None
        if self.settings.existing == "extend":
            try:
                read_caption(path)
            except UnicodeDecodeError:
                return ("its caption file is neither UTF-8 nor UTF-16 with a BOM, so it is not "
                        "extended (save it as UTF-8, or replace it: the old file is kept)")
        return None

    def write(self, image: Path, caption: Caption) -> list[Path]:
        path = self.caption_path(image)
        prefix = self.settings.prefix.strip()
        text = with_prefix(prefix, caption.text)
        if path.is_file():
            old = path.read_bytes()
            previous = read_caption(path) if self.settings.existing == "extend" else ""
            if previous:  # the prefix once, at the start of the caption it extends
                text = extended(with_prefix(prefix, previous) if not previous.startswith(prefix)
                                else previous, caption, self.tags)
            if old.strip():
                atomic_write_bytes(self.backup_root / path.relative_to(self.folder), old)
        atomic_write_text(path, text + "\n")
        return [path]


def with_prefix(prefix: str, text: str) -> str:
    return ", ".join(part for part in (prefix, text) if part)


def caption_folder(folder: Path, settings: CaptionSettings, hooks: JobHooks = JobHooks(),
                   stop: threading.Event | None = None,
                   cache_dir: Path | None = None) -> JobReport:
    """Caption `folder`'s images (see the module docstring). Raises JobRefused for bad
    settings, a folder it cannot work on, or a model it cannot get or load."""
    problems = validate(settings)
    if problems:
        raise JobRefused("; ".join(problems))
    folder = Path(folder)
    writer = CaptionWriter(folder, settings)
    kind = CAPTIONERS[settings.captioner]

    def load() -> BatchModel:
        device = pick_device(settings.device)
        weights = model_folder(settings.model, hooks.status, offline=settings.offline,
                               cache_dir=cache_dir, allow_patterns=kind.files)
        hooks.status(f"loading {kind.label} ({settings.model}) on the "
                     f"{'GPU' if device == 'cuda' else 'CPU'}")
        model = kind.make(weights, run_options(settings, device))
        for note in getattr(model, "notes", ()):
            hooks.status(note)
        return model

    job = FolderJob(kind="caption", settings=job_settings(settings), load=load,
                    needs_work=writer.needs_work, write=writer.write,
                    batch_size=settings.batch_size, recursive=settings.recursive)
    return run_job(folder, job, hooks, stop)


def run_options(settings: CaptionSettings, device: str) -> RunOptions:
    return RunOptions(device=device, prompt=settings.prompt, max_tokens=settings.max_tokens,
                      general_threshold=settings.general_threshold,
                      character_threshold=settings.character_threshold,
                      exclude_tags=settings.exclude_tags, keep_separator=settings.keep_separator)


def job_settings(settings: CaptionSettings) -> dict[str, Any]:
    """What makes two caption jobs the same job (a re-run continues only then): not where the
    model runs, the batch size or whether it may download."""
    values = dataclasses.asdict(settings)
    for name in ("device", "batch_size", "offline"):
        values.pop(name)
    values["exclude_tags"] = list(settings.exclude_tags)
    return values
