"""Make loss masks for a folder of images: `make_masks(folder, MaskSettings(...))`.

Each image gets `<stem>_mask.png` beside it (modules/data/masks.py: an 8-bit greyscale PNG of
the image's size after its EXIF rotation; white trains, black is left out), which
`data.masked_loss` reads. The mask comes from CLIPSeg with text prompts or from a background
remover (segmenters.py), shaped by `MaskShape` (mask_ops.py).

An image that has a mask already keeps it unless `existing="replace"`; a replaced mask is moved
into `.tempera-mask-backup/<date-time of the job>/` in the dataset folder (hidden, so no scan reads it),
under its path in the folder, never deleted. The folder job (job.py) does the rest: one job per
folder, Stop and continue, bad images named, progress, the model released at the end.
"""
from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from modules.data.file_kinds import MASK_SUFFIX
from modules.data.prep.job import (BatchModel, FolderJob, JobHooks, JobRefused, JobReport,
                                   run_job)
from modules.data.prep.fields import option
from modules.data.prep.mask_ops import MaskShape, shape_mask
from modules.data.prep.segmenters import (BACKGROUND_NAMES, DEFAULT_CLIPSEG, load_background,
                                          load_clipseg)
from modules.util.atomic import atomic_file

SEGMENTERS = ("clipseg", "background")
EXISTING = ("skip", "replace")
REPLACED_FOLDER = ".tempera-mask-backup"


@dataclass(frozen=True)
class MaskSettings:
    """What a mask job does. `segmenter`: "clipseg" (needs `prompts`) or "background"."""
    segmenter: str = "clipseg"
    prompts: tuple[str, ...] = ()
    model: str = ""                    # CLIPSeg: folder or repo id; background: a rembg model
    model_file: Path | None = None     # background: an .onnx file of `model`'s kind on disk
    shape: MaskShape = field(default_factory=MaskShape)
    existing: str = "skip"             # or "replace" (the old mask is kept, see module doc)
    batch_size: int = 4
    recursive: bool = False
    offline: bool = False
    device: str | None = None          # None: the GPU when there is one

    def model_name(self) -> str:
        """The model this job uses: `model`, else the segmenter's default."""
        if self.model:
            return self.model
        return DEFAULT_CLIPSEG if self.segmenter == "clipseg" else BACKGROUND_NAMES[0]

    def problems(self) -> list[str]:
        """What is wrong with these settings, one sentence each (empty when they are fine)."""
        out = list(self.shape.problems())
        if self.segmenter not in SEGMENTERS:
            out.append(f"segmenter: expected one of {', '.join(SEGMENTERS)}, "
                       f"got {self.segmenter!r}")
        if self.segmenter == "clipseg" and not [p for p in self.prompts if p.strip()]:
            out.append("prompts: CLIPSeg needs at least one prompt saying what to keep "
                       "(e.g. 'person', 'the dog')")
        if self.segmenter == "background" and self.prompts:
            out.append("prompts: the background remover takes no prompt (it keeps the "
                       "subject); use the clipseg segmenter to say what to keep")
        if self.segmenter == "background" and self.model_name() not in BACKGROUND_NAMES:
            out.append(f"model: the background remover's models are "
                       f"{', '.join(BACKGROUND_NAMES)}; got {self.model_name()!r}")
        if self.model_file is not None and self.segmenter != "background":
            out.append("model_file: only the background remover reads a single .onnx file; "
                       "for CLIPSeg name its folder as the model")
        if self.model_file is not None and not Path(self.model_file).expanduser().is_file():
            out.append(f"model_file: the background model file {self.model_file} does not "
                       "exist")
        if self.existing not in EXISTING:
            out.append(f"existing: expected one of {', '.join(EXISTING)}, got {self.existing!r}")
        if self.batch_size < 1:
            out.append(f"batch_size: expected 1 or more, got {self.batch_size}")
        return out

    def journal_settings(self) -> dict[str, Any]:
        """What makes two runs the same job (a re-run continues a stopped one only then)."""
        return {"segmenter": self.segmenter, "prompts": list(self.prompts),
                "model": self.model_name(),
                "model_file": str(self.model_file) if self.model_file else None,
                "shape": asdict(self.shape), "existing": self.existing,
                "recursive": self.recursive}


@dataclass(frozen=True)
class MaskForm:
    """A mask job's settings as one flat form (the Data tab's *Make masks…* window is built from
    these fields, their help and choices): `settings()` is the job's MaskSettings."""
    segmenter: str = option("clipseg", "clipseg: keep what the prompts name; background: keep "
                             "the subject, remove the background (rembg)", choices=SEGMENTERS)
    prompts: tuple[str, ...] = option((), "CLIPSeg: what to keep, comma-separated (e.g. "
                                       "person, the dog); each is kept")
    model: str = option("", "CLIPSeg: a Hugging Face repository id or a folder (empty: "
                         f"{DEFAULT_CLIPSEG}); background: one of {', '.join(BACKGROUND_NAMES)}")
    model_file: str = option("", "background: the model's .onnx file on disk, instead of "
                              "rembg's download")
    threshold: float = option(0.5, "a pixel at least this likely counts fully, the rest not "
                               "at all")
    soft: bool = option(False, "no threshold: keep the model's probabilities as grey levels")
    dilate: int = option(0, "grow what is kept by this many pixels (negative: shrink it)")
    blur: float = option(0.0, "soften the mask's edge with a Gaussian blur of this radius")
    invert: bool = option(False, "leave out what was found and train on the rest (e.g. a "
                           "watermark)")
    existing: str = option("skip", "an image that has a mask: keep it (skip) or replace it "
                            f"(the old one is moved into {REPLACED_FOLDER}/)", choices=EXISTING)
    recursive: bool = option(False, "the images of subfolders too (kohya's 10_name folders)")
    batch_size: int = option(4, "images per forward pass of CLIPSeg")
    device: str = option("auto", "where the model runs (auto: the GPU when there is one)",
                          choices=("auto", "cpu", "cuda"))
    offline: bool = option(False, "never download: a model that is not on disk is refused")

    def settings(self) -> MaskSettings:
        return MaskSettings(
            segmenter=self.segmenter, prompts=self.prompts, model=self.model,
            model_file=Path(self.model_file).expanduser() if self.model_file.strip() else None,
            shape=MaskShape(threshold=None if self.soft else self.threshold,
                            dilate=self.dilate, blur=self.blur, invert=self.invert),
            existing=self.existing, batch_size=self.batch_size, recursive=self.recursive,
            offline=self.offline, device=None if self.device == "auto" else self.device)


# The window's presets: (one line on what it is for, the form's values)
MASK_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": ("CLIPSeg keeps the people; a little grown and softened at the edge",
               {"segmenter": "clipseg", "prompts": ("person",), "dilate": 8, "blur": 2.0}),
    "subject": (f"rembg's {BACKGROUND_NAMES[0]} keeps the subject of each photo and removes "
                "the background", {"segmenter": "background", "model": BACKGROUND_NAMES[0]}),
    "no watermark": ("CLIPSeg finds text and watermarks; the mask leaves them out",
                     {"segmenter": "clipseg", "prompts": ("watermark", "text"), "dilate": 6,
                      "invert": True}),
}


def mask_preset(name: str) -> MaskForm:
    return MaskForm(**MASK_PRESETS[name][1])


def mask_path(image: Path) -> Path:
    """Where an image's loss mask lies: `cat.jpg` -> `cat_mask.png` beside it."""
    return image.with_name(image.stem + MASK_SUFFIX)


def make_masks(folder: Path, settings: MaskSettings, hooks: JobHooks = JobHooks(),
               stop: threading.Event | None = None) -> JobReport:
    """Write a mask for each image of `folder` that needs one (see the module docstring).
    Raises JobRefused when the job cannot start; otherwise returns the report (also when it
    stopped or failed)."""
    problems = settings.problems()
    if problems:
        raise JobRefused("; ".join(problems))
    return run_job(Path(folder), mask_job(Path(folder), settings, hooks), hooks, stop)


def mask_job(folder: Path, settings: MaskSettings, hooks: JobHooks) -> FolderJob:
    """The folder job that makes `settings`' masks in `folder`."""
    replaced_into = folder / REPLACED_FOLDER / time.strftime("%Y%m%d-%H%M%S")

    def load() -> BatchModel:
        if settings.segmenter == "clipseg":
            return Sized(load_clipseg(settings.model_name(), settings.prompts, hooks.status,
                                      offline=settings.offline, device=settings.device))
        return Sized(load_background(settings.model_name(), hooks.status,
                                     model_file=settings.model_file, offline=settings.offline,
                                     device=settings.device))

    def needs_work(image: Path) -> str | None:
        if settings.existing == "skip" and mask_path(image).exists():
            return "has a mask (replace it with existing='replace')"
        return None

    def write(image: Path, result: tuple[np.ndarray, tuple[int, int]]) -> list[Path]:
        probabilities, size = result
        mask = shape_mask(probabilities, size, settings.shape)
        target = mask_path(image)
        if target.exists():
            keep_replaced(target, folder, replaced_into)
        with atomic_file(target) as temporary:
            mask.save(temporary, format="PNG")
        if mask.getextrema()[1] == 0:
            hooks.status(f"{target.name}: the mask keeps no pixel (the image would train "
                         "nothing); try a lower threshold or another prompt")
        return [target]

    return FolderJob(kind="mask", settings=settings.journal_settings(), load=load,
                     needs_work=needs_work, write=write, batch_size=settings.batch_size,
                     recursive=settings.recursive)


class Sized:
    """A segmenter whose results carry their image's (width, height): the mask is written at
    the size the model was given (the image after its EXIF rotation, as the trainer reads it)."""

    def __init__(self, segmenter: Any) -> None:
        self.segmenter = segmenter

    def process(self, images: Sequence[Image.Image]) -> list[tuple[np.ndarray, tuple[int, int]]]:
        maps = self.segmenter.process(images)
        return [(probabilities, image.size) for probabilities, image in zip(maps, images)]

    def close(self) -> None:
        self.segmenter.close()
        self.segmenter = None


def keep_replaced(path: Path, folder: Path, into: Path) -> Path:
    """Move `path` (inside `folder`) under `into`, at its path relative to `folder`; returns
    where it went. A file already there is never overwritten: a number is added."""
    target = into / path.relative_to(folder)
    number = 1
    while target.exists():
        target = target.with_name(f"{path.stem}.{number}{path.suffix}")
        number += 1
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(path), str(target))
    return target
