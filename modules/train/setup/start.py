"""What `TrainingRecipe.setup` (train/recipe/recipe.py) calls on its way: the output folder's lock and
cleaning, the start of run.json, the dataset, and the learning rates after a restore.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from modules.config.caveats import config_warnings
from modules.config.optimizers import OPTIMIZERS
from modules.config.secret_settings import masked_config
from modules.config.problems import ConfigError, Problem
from modules.config.data import shapes_vary
from modules.data.buckets import ResolutionPlan, bucket_counts, resolution_plan
from modules.data.dataset import BucketBatchSampler, ImageCaptionDataset, expand_repeats
from modules.data.latent_cache import CachedLatentDataset
from modules.data.masks import mask_source
from modules.data.regularization import balanced_repeats
from modules.events import TrainerCallbacks
from modules.model_types import MODEL_TYPES
from modules.train.outputs.checkpoints import checkpoints_folder, list_checkpoints
from modules.train.outputs.previous_run import RUN_OUTPUTS
from modules.train.state.backup import ResumePoint, backups_folder
from modules.train.state.backup_files import list_backups
from modules.train.recipe.objectives import noise_schedule_record
from modules.train.setup.output_lock import OutputBusy, OutputLock, describe_owner
from modules.train.setup.prepare import PreparedRun
from modules.train.setup.run_captions import caption_rules, known_captions
from modules.train.outputs.record import RunRecord, device_description, library_versions
from modules.train.state.run import Run
from modules.paths import cache_dir_for
from modules.train.recipe.text_cache import (TextEncoderCache, text_encoder_leaves_device,
                                             varying_datasets)
from modules.train.recipe.text_store import TextEmbeddingStore, encoder_identity
from modules.util.atomic import (atomic_write_text, remove_temporaries,
                                  restore_interrupted_swaps)

if TYPE_CHECKING:  # imported where a run builds them, only when the option is on
    from diffusers.training_utils import EMAModel
    from torch.utils.tensorboard import SummaryWriter

def clear_previous_run(output_dir: Path) -> list[str]:
    """Remove an earlier run's samples, TensorBoard logs, backups, best/ and checkpoints so
    they do not mix with the new run's (old samples in the Run tab, two runs' curves in one
    TensorBoard, an old backup `--resume latest` would pick, old checkpoints kept by the
    rotation). Only Tempera's own checkpoint folders go; everything else stays.
    `modules.train.outputs.previous_run` says beforehand what this removes."""
    import shutil
    cleared = []
    for name in RUN_OUTPUTS:
        if (output_dir / name).is_dir():
            shutil.rmtree(output_dir / name)
            cleared.append(f"{name}/")
    checkpoints = list_checkpoints(output_dir)
    for _, _, folder in checkpoints:
        shutil.rmtree(folder)
    if checkpoints:
        cleared.append(f"{len(checkpoints)} checkpoint(s) (" + ", ".join(
            name for _, name, _ in checkpoints) + ")")
        if not any(checkpoints_folder(output_dir).iterdir()):  # else the user's files stay
            checkpoints_folder(output_dir).rmdir()
    return cleared


def take_output_lock(output_dir: Path, callbacks: TrainerCallbacks) -> OutputLock:
    """Hold the output folder for this run; a lock left by a dead run is taken over, out loud."""
    try:
        lock = OutputLock(output_dir).acquire()
    except OutputBusy as exc:  # another start won the race since prepare_run looked
        raise ConfigError([Problem("output.dir", "a folder no other training is writing into",
                                   repr(str(output_dir)), str(exc))]) from exc
    if lock.previous:
        callbacks.on_status(f"took over the output folder's lock from a run that ended without "
                            f"releasing it ({describe_owner(lock.previous)})")
    return lock


def clean_output_folder(output_dir: Path, callbacks: TrainerCallbacks,
                        overwrite: bool) -> list[str]:
    """Under the lock (no save is under way): remove leftovers of interrupted saves, and with
    `overwrite` the previous run's outputs that would mix with this one's (returned, for
    run.json)."""
    folders = [output_dir, output_dir / "checkpoints", output_dir / "samples",
               backups_folder(output_dir)]
    for restored in restore_interrupted_swaps(folders):
        callbacks.on_status(f"restored {restored.name}/: a save that was replacing it was "
                            "interrupted before the new one was in place")
    freed = remove_temporaries(folders)
    cleared = clear_previous_run(output_dir) if overwrite else []
    if cleared:
        callbacks.on_status("output.overwrite: removed the previous run's " + ", ".join(cleared))
    if freed:
        callbacks.on_status(f"removed partly written saves of an interrupted run "
                            f"({freed / 2**20:,.1f} MB freed)")
    return cleared


def model_identity(path: str) -> str:
    """run.json's `model_identity`: a built-in model by name and fingerprint (its cache folder
    may differ between machines and resumes), any other model by its path."""
    from modules.models.tiny import builtin_identity
    return builtin_identity(path) or path


def continue_record(record: RunRecord, resume: ResumePoint) -> None:
    """A resumed run's run.json goes on from the interrupted one's."""
    try:
        previous = json.loads(record.path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        previous = {}  # resuming from a backup copied elsewhere: a new record
    record.continue_from(previous, resume.step, resumed_from=str(resume.folder),
                         resume_changed=resume.changed,
                         # written on every resume, so an earlier resume's list never lingers
                         resume_skipped_backups=resume.skipped,
                         compile_state="not in backups: the persistent compile cache makes "
                                       "the resumed run's compile warm")


def bucket_record(target_sizes: list[tuple[int, int]], batches: BucketBatchSampler,
                  plan: ResolutionPlan | None = None) -> dict:
    """run.json's `buckets` section: items per bucket and this rank's batches per epoch, and
    with `plan` the table per resolution (its buckets and their item counts)."""
    record = {"sizes": bucket_counts(target_sizes), "batches_per_epoch": len(batches),
              "short_batches_per_epoch": batches.short_batches()}
    if plan is not None:
        record["resolutions"] = plan.table()
    return record


def source_loss_weights(config) -> list[float]:
    """Each dataset's loss weight (regularisation folders: training.prior_loss_weight), or []
    when no dataset is one (the batches then carry no weights at all)."""
    datasets = config.data.datasets
    if not any(ds.regularization for ds in datasets):
        return []
    return [config.training.prior_loss_weight if ds.regularization else 1.0 for ds in datasets]


def regularization_record(scan) -> dict | None:
    """run.json's `regularization` section, when a folder holds class images: samples per
    epoch on each side and the class images left unused."""
    _, balance = balanced_repeats(scan)
    return None if balance is None else dataclasses.asdict(balance)


def mask_counts(scan) -> dict[str, int]:
    """How many images take their loss mask from a mask file, from their alpha channel, and
    how many have none (they train on the whole image): run.json's `masked_loss`."""
    counts = {"file": 0, "alpha": 0, "none": 0}
    for item in scan.items:
        counts[mask_source(item.mask, item.alpha)] += 1
    return counts


def describe_masks(counts: dict[str, int]) -> str:
    line = (f"masked loss: {counts['file']} image(s) use a mask file, {counts['alpha']} their "
            "alpha channel")
    if counts["none"]:
        line += f"; {counts['none']} have no mask and train on the whole image"
    return line


def build_dataset(prepared: PreparedRun, callbacks: TrainerCallbacks,
                  should_stop: Callable[[], bool] = lambda: False
                  ) -> ImageCaptionDataset | CachedLatentDataset:
    """The training dataset, with latents encoded into the on-disk cache first when enabled.

    With `data.aspect_buckets` each item gets the bucket nearest its aspect ratio, from the
    size the scan read; with several resolutions (data.resolutions, a dataset's own) each
    image is a sample at each of them (`plan_resolutions`).
    """
    config = prepared.config
    items = expand_repeats(prepared.scan)
    balance = balanced_repeats(prepared.scan)[1]
    if balance is not None:
        callbacks.on_status(balance.describe())
    plan = resolution_plan(config.data, items)  # check_run said what it makes of them
    # None: every item a data.resolution square, the path runs took before resolution lists
    # (a dataset's own single resolution is another square, so it needs the sizes too)
    same_as_before = (not shapes_vary(config.data)
                      and plan.distinct == [config.data.resolution])
    target_sizes = None if same_as_before else plan.target_sizes
    dataset = ImageCaptionDataset(plan.items, resolution=config.data.resolution,
                                  center_crop=config.data.center_crop,
                                  random_flip=config.data.random_flip, seed=config.training.seed,
                                  target_sizes=target_sizes, caption_rules=caption_rules(config),
                                  loss_weights=source_loss_weights(config),
                                  masked_loss=config.data.masked_loss)
    if config.data.masked_loss:
        callbacks.on_status(describe_masks(mask_counts(prepared.scan)))
    if not config.data.cache_latents:
        return dataset
    from modules.train.recipe.latents import cached_latent_dataset
    return cached_latent_dataset(dataset, prepared, callbacks, should_stop)


def apply_changed_learning_rates(run: Run) -> None:
    """After a restore, each parameter group's base learning rate is the config's (a resume may
    change it) and its current rate is the schedule's at the restored step. With an unchanged
    config this recomputes exactly the rate the backup held."""
    scheduler = run.lr_scheduler
    for i, group in enumerate(run.optimizer.param_groups):
        key = MODEL_TYPES[run.config.model.type].config_key(group["name"])
        own = getattr(run.config.components, key).learning_rate
        base = run.config.training.learning_rate if own is None else own
        group["initial_lr"] = base
        scheduler.base_lrs[i] = base
        lmbda = getattr(scheduler, "lr_lambdas", [None])[i]
        if lmbda is not None:
            group["lr"] = base * lmbda(scheduler.last_epoch)


def prepare_output_folder(prepared: PreparedRun, callbacks: TrainerCallbacks,
                          is_main: bool) -> RunRecord:
    """Under the lock: clean the output folder, write config.json, and start run.json (continued
    from the interrupted run's when resuming). Every process gets the record; only the main
    one writes it."""
    config = prepared.config
    output_dir = Path(config.output.dir)
    # Resuming continues the run in the folder: output.overwrite (on in presets such as the
    # demo, for repeated fresh starts) is not applied, and the run says so.
    overwrite_ignored = bool(config.output.overwrite and prepared.resume is not None)
    if overwrite_ignored:
        callbacks.on_status(f"output.overwrite is not applied: resuming continues the run in "
                            f"{output_dir} (nothing of it is removed)")
    cleared: list[str] = []
    if is_main:
        cleared = clean_output_folder(output_dir, callbacks,
                                      overwrite=config.output.overwrite and prepared.resume is None)
        (output_dir / "samples").mkdir(parents=True, exist_ok=True)
        # secret-looking values masked (modules/config/secret_settings.py)
        atomic_write_text(output_dir / "config.json",
                          json.dumps(masked_config(config), indent=2) + "\n")
    record = RunRecord(output_dir / "run.json", enabled=is_main)
    if prepared.resume is not None:
        continue_record(record, prepared.resume)
        for note in ("overwrite", "final", "final_kept"):  # how the earlier segment ended
            record.data.pop(note, None)
    if overwrite_ignored:
        record.data["overwrite"] = "not applied: a resume continues the run in this folder"
    elif cleared:
        record.data["overwrite"] = {"removed": cleared}
    return record


def start_record(record: RunRecord, prepared: PreparedRun, device: torch.device) -> None:
    """run.json's first section: status running, the machine, the model and the dataset."""
    config = prepared.config
    record.write(status="running", versions=library_versions(),
                 device=device_description(device), model_type=config.model.type.value,
                 model_identity=model_identity(config.model.path),
                 method=config.training.method.value,
                 weight_dtype=config.model.weight_dtype.value,
                 train_dtype=config.model.train_dtype.value,
                 mixed_precision=config.training.mixed_precision.value,
                 noise_schedule=noise_schedule_record(prepared.bundle),
                 dataset={"images": len(prepared.scan.items), "skipped": len(prepared.scan.skipped),
                          "skipped_files": [str(p) for p, _ in prepared.scan.skipped]},
                 regularization=regularization_record(prepared.scan),
                 masked_loss=(mask_counts(prepared.scan) if config.data.masked_loss else None),
                 # the plan's lower bound, to set beside memory.peak_allocated_bytes
                 memory_plan=prepared.memory.record() if prepared.memory else None)


def warmup_warning(config, total_steps: int) -> str | None:
    """A warm-up longer than a run counted in epochs (validation refuses it when
    training.max_steps says the length): the rate would still be rising at the end."""
    t = config.training
    if OPTIMIZERS[t.optimizer].own_step_size or t.lr_warmup_ratio:
        return None
    if t.lr_warmup_steps <= total_steps:
        return None
    return (f"training.lr_warmup_steps is {t.lr_warmup_steps}, longer than the run's "
            f"{total_steps} steps: the rate is still rising when the run ends, at "
            f"{total_steps / t.lr_warmup_steps:.0%} of training.learning_rate (lower the "
            "warm-up, or set it as training.lr_warmup_ratio)")


def record_warnings(record: RunRecord, config, total_steps: int,
                    callbacks: TrainerCallbacks) -> None:
    """run.json's `warnings`: the config's caveats (said by check_run already) and what the
    run's length adds, which is said now."""
    late = [w for w in (warmup_warning(config, total_steps),) if w]
    for warning in late:
        callbacks.on_status(f"warning: {warning}")
    record.write(warnings=config_warnings(config) + late)


def build_ema(config, params: dict) -> EMAModel | None:
    """The exponential moving average of the trained weights, when training.ema is on."""
    if not config.training.ema:
        return None
    from diffusers.training_utils import EMAModel
    return EMAModel([p for plist in params.values() for p in plist],
                    decay=config.training.ema_decay)


def text_encoder_cache(prepared: PreparedRun, bundle, device: torch.device,
                       callbacks: TrainerCallbacks) -> TextEncoderCache | None:
    """The text encoder outputs' cache when data.cache_text_encoder_outputs is on, on disk
    under <cache folder>/text-embeddings (keyed by caption and encoder identity). Called before
    the model moves to the device: when the encoder can leave it (`text_encoder_leaves_device`)
    every caption the run will read is encoded first, with the encoder alone on the device,
    and the encoder then stays on the CPU for the whole run; a run that loaded the encoder
    first (train/setup/text_first.py) has its cache built and the encoder released already. Datasets whose captions change
    every epoch are named up front: their captions are encoded at each step and the encoder
    stays on the device."""
    config = prepared.config
    if not config.data.cache_text_encoder_outputs:
        return None
    if prepared.text_cache is not None:  # every caption cached, the encoder released already
        prepared.text_cache.device = device
        return prepared.text_cache
    store = TextEmbeddingStore(cache_dir_for(config.general.cache_dir) / "text-embeddings",
                               encoder_identity(bundle))
    cache = TextEncoderCache(bundle, device, store)
    varying = varying_datasets(config)
    if varying:
        callbacks.on_status(f"{'; '.join(varying)} change their captions every epoch: their "
                            "text encoder outputs are encoded at each step, not cached, and "
                            "the text encoder stays on the device")
    if not text_encoder_leaves_device(config):
        return cache
    encoders = list(bundle.text_encoders.values())
    for module in encoders:
        module.to(device)
    captions = known_captions(prepared)
    encoded = cache.precache(captions)
    for module in encoders:
        module.to("cpu")
    callbacks.on_status(f"text encoder outputs: {len(captions)} captions cached on disk "
                        f"({encoded} encoded now, {len(captions) - encoded} read from "
                        f"{store.folder}); the text encoder left the {device.type} device")
    return cache


def tensorboard_writer(config, is_main: bool) -> SummaryWriter | None:
    """TensorBoard's writer into <output>/tensorboard (the main process only), when on."""
    if not (config.logging.tensorboard and is_main):
        return None
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(str(Path(config.output.dir) / "tensorboard"))


def resume_hint(output_dir: Path) -> str:
    """The end of a stopped or failed run's message: how to resume, or that nothing can be
    (a stop before the first step, a disk full before the first backup): never a pointer to a
    backups folder that does not exist."""
    found = list_backups(output_dir)
    if not found:
        return "; nothing to resume (no backup was written)"
    step, folder = found[-1]
    return f"; resume with --resume latest (newest backup: step {step}, {folder})"
