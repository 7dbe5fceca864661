"""Everything a run needs that can fail because of the user's input, done before any file is written.

A problem found here is a ConfigError (exit code 2 from the CLI, a list in the GUI), never a crash
after the output folder has been touched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from modules.config.caveats import config_warnings
from modules.config.loader import from_dict, to_dict
from modules.config.problems import ConfigError, Problem
from modules.config.prompts import SamplePrompt, sample_prompts
from modules.config.data import shapes_vary, trained_resolutions
from modules.config.schema import BUILTIN_PREFIX, Config
from modules.config.secret_settings import masked_config, secret_warnings
from modules.compile.ahead_rules import ahead_problems
from modules.config.validate import validate
from modules.data.captions import CaptionsFileError, load_captions_file
from modules.data.progress import RateMeter
from modules.data.folders import DatasetError, DatasetSource, ScanResult, scan_datasets
from modules.events import TrainerCallbacks
from modules.models.bundle import ModelBundle
from modules.models.loader import load_bundle, resolve_model_path
from modules.paths import cache_dir_for
from modules.runtime import runtime_problems
from modules.train.state.backup import BackupError, ResumePoint, resume_point
from modules.train.recipe.builders import pick_device
from modules.train.recipe.distributed import launched_distributed
from modules.train.memory.memory_check import MemoryCheck, check_memory
from modules.train.state.resume_offer import finished_run_problem, resume_offer
from modules.train.setup.inputs import check_inputs
from modules.train.recipe.loss_checks import family_problems, model_problems
from modules.train.setup.output_lock import busy_message
from modules.train.validation.validation_set import ValidationImages, choose_validation
from modules.util.errors import first_line
from modules.train.recipe.trainable import component_dtypes, stored_components
from modules.train.recipe.text_cache import TextEncoderCache, text_encoder_first
from modules.train.setup.text_first import encode_text_first, load_model_after_text


@dataclass
class PreparedRun:
    config: Config          # fully resolved: real folders instead of builtin names
    device: torch.device
    cache_dir: Path
    bundle: ModelBundle
    scan: ScanResult
    resume: ResumePoint | None = None  # the backup this run continues from
    validation: ValidationImages | None = None  # scored every validation.every_steps
    memory: MemoryCheck | None = None  # the device memory plan, for run.json
    # the sample prompts, read once by `check_run` (setup samples these; it never reads the
    # prompts file again, so a file changed or gone since cannot silently leave none)
    prompts: list[SamplePrompt] = field(default_factory=list)
    # every caption cached before the model loaded, the text encoder released
    # (train/setup/text_first.py); None: the text encoder loaded with the rest
    text_cache: TextEncoderCache | None = None


def resolve_dataset_path(path: str, cache_dir: Path) -> Path:
    """The real folder behind a dataset path; built-in datasets are generated into the cache."""
    if path.startswith(BUILTIN_PREFIX):
        from modules.data.shapes import DATASET_BUILDERS
        return DATASET_BUILDERS[path](cache_dir)  # validation accepted only known names
    return Path(path)


@dataclass
class CheckedRun:
    """Everything about a run's inputs that is known without loading the model."""
    config: Config          # resolved: real folders instead of builtin names
    cache_dir: Path
    scan: ScanResult
    model_path: Path
    resume: ResumePoint | None
    validation: ValidationImages | None = None
    memory: MemoryCheck | None = None  # the device memory plan (refused if over the card)
    # samples per epoch over several resolutions, and their shape sets' compile cost
    shape_plan: list[str] = field(default_factory=list)
    prompts: list[SamplePrompt] = field(default_factory=list)  # what `PreparedRun` says


def check_run(config: Config, callbacks: TrainerCallbacks) -> CheckedRun:
    """Every check a start runs short of loading the model: software, config, inputs on disk
    (model files' headers, datasets, output folder), the dataset scan, the backup to resume,
    the device memory plan (train/memory/memory_check.py: a run that cannot fit the GPU is refused).
    `tempera-train --check` stops here; raises ConfigError with every problem found."""
    problems = (runtime_problems() + validate(config) + ahead_problems(config)
                + family_problems(config))
    busy = busy_message(Path(config.output.dir)) if config.output.dir.strip() else None
    if busy:
        problems.append(Problem("output.dir", "a folder no other training is writing into",
                                repr(config.output.dir), busy))
    if not problems:
        problems = check_inputs(config)
    if problems:
        raise ConfigError(problems)
    for warning in secret_warnings(config):
        callbacks.on_status(warning)
    for warning in config_warnings(config):  # run.json records them too (start_record)
        callbacks.on_status(f"warning: {warning}")
    cache_dir = cache_dir_for(config.general.cache_dir)
    resolved = from_dict(to_dict(config))
    resolved.general.cache_dir = str(cache_dir)
    prompts, problems = sample_prompts(resolved)  # the one read the run samples from
    if problems:  # check_inputs read the prompts file a moment ago: changed or gone since
        raise ConfigError(problems)

    callbacks.on_status("scanning datasets")
    for ds in resolved.data.datasets:
        ds.path = str(resolve_dataset_path(ds.path, cache_dir))
    try:
        sources = [DatasetSource(Path(ds.path), ds.repeats,
                                 load_captions_file(Path(ds.captions_file))
                                 if ds.captions_file else None,
                                 default_caption=ds.class_caption,
                                 regularization=ds.regularization)
                   for ds in resolved.data.datasets]
    except CaptionsFileError as exc:  # check_inputs read it a moment ago: changed since
        raise ConfigError([Problem("data.datasets", "readable captions files", str(exc))]) \
            from exc
    try:
        scan = scan_datasets(sources, caption_extension=resolved.data.caption_extension,
                             recursive=resolved.data.recursive,
                             # the smallest image is judged against the largest size
                             resolution=max(trained_resolutions(resolved.data)),
                             check_masks=resolved.data.masked_loss,
                             progress=lambda folder: RateMeter(f"scanning {folder.name}",
                                                               callbacks.on_status))
    except DatasetError as exc:
        raise ConfigError([Problem("data.datasets", "folders with at least one readable image",
                                   str(exc))]) from exc
    callbacks.on_status(f"dataset: {scan.summary()}")
    problems = scan_problems(resolved, scan, callbacks)
    if problems:
        raise ConfigError(problems)
    if scan.skipped:
        reasons = sorted({"unsupported format" if r.startswith("unsupported") else "unreadable"
                          for _, r in scan.skipped})
        callbacks.on_status(f"skipped {len(scan.skipped)} image file(s) "
                            f"({' or '.join(reasons)}); the log lists each with its reason")
    for warning in scan.warnings:
        callbacks.on_status(f"dataset warning: {warning}")
    scan, validation = choose_validation(resolved, scan)  # held-out images leave the scan
    if validation is not None:
        callbacks.on_status(f"validation: {validation.origin}")
    shape_plan = shape_plan_lines(resolved, scan)
    for line in shape_plan:
        callbacks.on_status(line)
    model_path = resolve_model_path(config.model.path, cache_dir)
    resolved.model.path = str(model_path)
    resume = check_resume(resolved, callbacks)
    if stored_components(resolved) and launched_distributed():
        storage = resolved.model.weight_storage.value
        raise ConfigError([Problem(
            "model.weight_storage", "WEIGHT_DTYPE with several processes", storage,
            f"{storage.lower()} weight storage is not tested with DistributedDataParallel yet "
            f"(its broadcast of every weight at the start meets the {storage.lower()} "
            "weights); train in one process, or use WEIGHT_DTYPE")])
    if resolved.model.offload_blocks and launched_distributed():
        raise ConfigError([Problem(
            "model.offload_blocks", "0 with several processes", str(resolved.model.offload_blocks),
            "block offload is not tested with DistributedDataParallel yet (its broadcast of "
            "every weight at the start would meet blocks whose weights are in CPU memory); "
            "train in one process, or use 0")])
    # before the model is loaded or anything reaches the GPU: a run that cannot fit stops here
    memory = check_memory(resolved, model_path, pick_device(config.general.device),
                          distributed=launched_distributed())
    if memory.summary():
        callbacks.on_status(memory.summary())
    for warning in memory.warnings:
        callbacks.on_status(f"memory: {warning}")
    return CheckedRun(resolved, cache_dir, scan, model_path, resume, validation, memory,
                      shape_plan, prompts)


def shape_plan_lines(config: Config, scan: ScanResult) -> list[str]:
    """What the resolutions and buckets make of the scanned images, said before the model
    loads: the samples per epoch (images x resolutions, what the step budget counts) and the
    compile cost of their shape sets (modules/compile/shape_sets.py)."""
    from modules.data.buckets import resolution_plan
    from modules.data.dataset import expand_repeats
    from modules.train.recipe.compile_guard import denoiser_compile_cost
    items = expand_repeats(scan)
    plan = resolution_plan(config.data, items)
    lines = []
    if len(plan.distinct) > 1:
        per = ", ".join(f"{row['resolution']} px: {row['items']}" for row in plan.table())
        lines.append(f"resolutions: {len(items)} samples x {len(plan.distinct)} resolutions "
                     f"({per}) = {len(plan.items)} samples per epoch; the step budget and "
                     "the ETA count them all")
    if shapes_vary(config.data):
        cost = denoiser_compile_cost(config, plan.shape_sets(config.training.batch_size))
        if cost is not None:
            lines.append(cost.describe())
    return lines


def scan_problems(config: Config, scan: ScanResult, callbacks: TrainerCallbacks
                  ) -> list[Problem]:
    """What the scan found that would train nothing, as problems: a captions file none of
    whose names is an image of its folder (the folder would train unconditioned), every
    image's loss mask keeping no pixel (the loss is exactly 0). Less than all of either is
    a warning naming the files."""
    problems = []
    for index, names in sorted(scan.unmatched_captions.items()):
        ds = config.data.datasets[index]
        listed = len(scan.sources[index].captions or {})
        images = [item.path.relative_to(ds.path).as_posix() for item in scan.items
                  if item.source_index == index][:3]
        if len(names) == listed:
            problems.append(Problem(
                f"data.datasets[{index}].captions_file", "a file naming the images of "
                f"data.datasets[{index}].path (by file name or by path inside the folder)",
                repr(ds.captions_file), f"none of its {listed} names is an image there (it "
                f"names {_few(names)}; the folder holds {_few(images)}), so every image would "
                "train without its caption: use the captions file of this folder, or fix the "
                "names"))
        else:
            callbacks.on_status(f"dataset warning: {len(names)} of the {listed} names in "
                                f"{ds.captions_file} are no image of {ds.path}: {_few(names)}")
    if scan.blank_masks and len(scan.blank_masks) == len(scan.items):
        problems.append(Problem(
            "data.masked_loss", "loss masks that keep some pixels (white counts, black is "
            "left out)", "true", f"every image's mask is all black or fully transparent "
            f"({_few([p.name for p in scan.blank_masks])}), so the loss would be exactly 0 and "
            "nothing would train: are the masks inverted? Turn data.masked_loss off to train "
            "on whole images"))
    elif scan.blank_masks:
        callbacks.on_status(f"dataset warning: {len(scan.blank_masks)} image(s) have a mask "
                            "that keeps no pixel (all black or fully transparent: inverted?); "
                            f"they train nothing: {_few([p.name for p in scan.blank_masks])}")
    return problems


def _few(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def prepare_run(config: Config, callbacks: TrainerCallbacks) -> PreparedRun:
    """Check everything (`check_run`), then load the model, its text encoder first and alone
    when the run caches every caption up front (`text_encoder_first`); raise ConfigError on
    any problem."""
    checked = check_run(config, callbacks)
    text_cache = None
    try:
        if not text_encoder_first(checked.config):
            text_cache = encode_text_first(checked, callbacks)
        callbacks.on_status("loading model")
        bundle = (load_model_after_text(checked, text_cache) if text_cache is not None else
                  load_bundle(checked.model_path, config.model, component_dtypes(config)))
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ConfigError([Problem("model.path", "a loadable diffusers model folder",
                                   repr(str(checked.model_path)), first_line(exc))]) from exc
    problems = model_problems(config, bundle)
    if problems:
        raise ConfigError(problems)
    return PreparedRun(checked.config, pick_device(config.general.device), checked.cache_dir,
                       bundle, checked.scan, checked.resume, checked.validation, checked.memory,
                       checked.prompts, text_cache)


def check_resume(resolved: Config, callbacks: TrainerCallbacks) -> ResumePoint | None:
    """The backup `training.resume_from` names, read whole and checked intact and against this
    config (exit 2 if not). Damaged newer backups that "latest" passed over are named."""
    if not resolved.training.resume_from:
        return None
    finished = finished_run_problem(Path(resolved.output.dir), resolved.training.resume_from,
                                    resolved.training.max_steps)
    if finished:  # a finished run continues only past its end
        raise ConfigError([finished])
    if resolved.training.resume_from == "latest":  # the offer's own backup: say what it does
        note = resume_offer(Path(resolved.output.dir),
                            resolved.training.max_steps).continue_note()
        if note:
            callbacks.on_status(note)
    callbacks.on_status("checking the backup to resume")
    try:
        # backup.json holds the config masked (modules/config/secret_settings.py): compare alike
        point = resume_point(Path(resolved.output.dir), resolved.training.resume_from,
                             masked_config(resolved))
        for why in point.skipped:
            callbacks.on_status(f"skipped a damaged backup: {why}")
        return point
    except BackupError as exc:
        raise ConfigError([Problem("training.resume_from", '"latest" or a backup folder that '
                                   "fits this config", repr(resolved.training.resume_from),
                                   str(exc))]) from exc
