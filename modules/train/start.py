"""Starting a run: the first write into the output folder, then everything the loop needs.

`start_run` takes the output folder's lock, writes config.json and run.json (continued when the
run resumes), builds the trained weights, optimizer, schedule, data, compile guard, EMA and
TensorBoard writer into one `Run`, and loads the backup being resumed into it.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from modules.config.prompts import sample_prompts
from modules.config.secret_settings import masked_config
from modules.config.problems import ConfigError, Problem
from modules.config.schema import MixedPrecision
from modules.data.captions import CaptionRules
from modules.data.buckets import assign_buckets, bucket_counts, describe_buckets
from modules.data.dataset import ImageCaptionDataset, epoch_batch_sampler, expand_repeats
from modules.events import StopRequested, TrainerCallbacks, TrainerCommands
from modules.model_types import MODEL_TYPES
from modules.train.backup import ResumePoint, backups_folder, load_states
from modules.train.builders import (build_lr_scheduler, build_optimizer, float32_precision,
                                    step_budget)
from modules.train.compile_guard import build_compile_guard
from modules.train.distributed import Distributed
from modules.train.output_lock import OutputBusy, OutputLock, describe_owner
from modules.train.prepare import PreparedRun
from modules.train.record import RunRecord, device_description, library_versions
from modules.train.run import Run, item_buckets
from modules.train.state import TrainingState, draws_generator
from modules.train.text_cache import TextEncoderCache
from modules.util.atomic import atomic_write_text, remove_temporaries
from modules.train.weights import (apply_denoiser_memory_format, enable_gradient_checkpointing,
                                   prepare_trainable, trained_components)


def start_run(prepared: PreparedRun, callbacks: TrainerCallbacks, dist: Distributed,
              commands: TrainerCommands | None = None) -> Run:
    """Create the output folder and everything the loop needs; the first write happens here.
    The output folder's lock is let go again if building the run fails. A Stop during latent
    caching raises StopRequested, with run.json saying `stopped`."""
    lock = (take_output_lock(Path(prepared.config.output.dir), callbacks) if dist.is_main
            else None)
    try:
        return build_run(prepared, callbacks, dist, lock, commands or TrainerCommands())
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def build_run(prepared: PreparedRun, callbacks: TrainerCallbacks, dist: Distributed,
              lock: OutputLock | None, commands: TrainerCommands) -> Run:
    config, bundle = prepared.config, prepared.bundle
    device = dist.device or prepared.device
    output_dir = Path(config.output.dir)
    # Resuming continues the run in the folder: output.overwrite (on in presets such as the
    # demo, for repeated fresh starts) is not applied, and the run says so.
    overwrite_ignored = bool(config.output.overwrite and prepared.resume is not None)
    if overwrite_ignored:
        callbacks.on_status(f"output.overwrite is not applied: resuming continues the run in "
                            f"{output_dir} (nothing of it is removed)")
    if dist.is_main:
        clean_output_folder(output_dir, callbacks,
                            overwrite=config.output.overwrite and prepared.resume is None)
        (output_dir / "samples").mkdir(parents=True, exist_ok=True)
        # secret-looking values masked (modules/config/secret_settings.py)
        atomic_write_text(output_dir / "config.json",
                          json.dumps(masked_config(config), indent=2) + "\n")
    record = RunRecord(output_dir / "run.json", enabled=dist.is_main)
    if prepared.resume is not None:
        continue_record(record, prepared.resume)
        for note in ("overwrite", "final", "final_kept"):  # how the earlier segment ended
            record.data.pop(note, None)
    if overwrite_ignored:
        record.data["overwrite"] = "not applied: a resume continues the run in this folder"
    record.write(status="running", versions=library_versions(),
                 device=device_description(device), model_type=config.model.type.value,
                 model_identity=model_identity(config.model.path),
                 method=config.training.method.value,
                 weight_dtype=config.model.weight_dtype.value,
                 train_dtype=config.model.train_dtype.value,
                 mixed_precision=config.training.mixed_precision.value,
                 dataset={"images": len(prepared.scan.items), "skipped": len(prepared.scan.skipped),
                          "skipped_files": [str(p) for p, _ in prepared.scan.skipped]})

    torch.manual_seed(config.training.seed)  # LoRA init draws from the global generator
    trained = trained_components(config)
    params = prepare_trainable(bundle, config)
    if config.training.gradient_checkpointing:
        enable_gradient_checkpointing(bundle, trained)
    for module in bundle.components().values():
        module.to(device)
    apply_denoiser_memory_format(bundle, config)

    try:
        dataset = build_dataset(prepared, callbacks, lambda: commands.stop_requested)
    except StopRequested:
        # no step was trained: nothing to back up; a resumed run's backups stay as they were
        record.write(status="stopped", stopped_during="latent caching")
        raise
    batches = epoch_batch_sampler(len(dataset), config.training.batch_size,
                                  config.training.seed, rank=dist.rank,
                                  world_size=dist.world_size,
                                  buckets=item_buckets(config, dataset))
    budget = step_budget(config, len(batches))
    if config.data.aspect_buckets:
        record.write(buckets=bucket_record(dataset.target_sizes, batches))
        callbacks.on_status(f"aspect buckets: {describe_buckets(dataset.target_sizes)}; "
                            f"{len(batches)} batches per epoch, {batches.short_batches()} short")
    optimizer = build_optimizer(config, params)
    scaler = (torch.amp.GradScaler(device.type)
              if config.training.mixed_precision == MixedPrecision.FP16 else None)
    restore_precision, precision = float32_precision(config, device)
    guard = build_compile_guard(config, bundle, device, params, trained, callbacks)
    if guard.persistent_grads:
        for plist in params.values():
            for p in plist:
                p.grad = torch.zeros_like(p)
    record.write(precision=precision,
                 sampling="eager: compiled code is bypassed while sampling")
    components = bundle.components()
    forward = dist.wrap_trained({name: components[name] for name in trained})  # compile, then wrap
    ema = None
    if config.training.ema:
        from diffusers.training_utils import EMAModel
        ema = EMAModel([p for plist in params.values() for p in plist],
                       decay=config.training.ema_decay)
    text_cache = TextEncoderCache(bundle, device) if config.data.cache_text_encoder_outputs else None
    varying = [i for i, rules in enumerate(caption_rules(config)) if rules.varies]
    if text_cache is not None and varying:
        callbacks.on_status(f"data.datasets{varying} change their captions every epoch "
                            "(shuffled or dropped tags): their text encoder outputs are "
                            "encoded at each step, not cached")
    writer = None
    if config.logging.tensorboard and dist.is_main:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(str(output_dir / "tensorboard"))
    state = TrainingState(generator=draws_generator(config.training.seed, dist.rank))
    run = Run(config, bundle, device, output_dir, record, callbacks, dataset, batches, params,
              optimizer, build_lr_scheduler(config, optimizer, budget.total_steps), budget,
              guard, dist, state, scaler=scaler, writer=writer, trained=trained, ema=ema,
              text_cache=text_cache, forward=forward, restore_precision=restore_precision,
              lock=lock, prompts=sample_prompts(config)[0])  # check_inputs read them already
    if prepared.resume is not None:
        resume_run(run, prepared.resume)
    run.mark_boundary()
    return run


# An earlier run's outputs that would mix with a new run's. Weights (final/, checkpoints/) are
# not among them: they are replaced atomically as the new run saves, so a new run that fails
# early never costs the user the previous run's weights.
RUN_OUTPUTS = ("samples", "tensorboard", "backups")


def clear_previous_run(output_dir: Path) -> list[str]:
    """Remove an earlier run's samples, TensorBoard logs and backups so they do not mix with
    the new run's (old samples in the Run tab, two runs' curves in one TensorBoard, an old
    backup `--resume latest` would pick). Everything else stays."""
    import shutil
    cleared = []
    for name in RUN_OUTPUTS:
        if (output_dir / name).is_dir():
            shutil.rmtree(output_dir / name)
            cleared.append(f"{name}/")
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


def clean_output_folder(output_dir: Path, callbacks: TrainerCallbacks, overwrite: bool) -> None:
    """Under the lock (no save is under way): remove leftovers of interrupted saves, and with
    `overwrite` the previous run's outputs that would mix with this one's."""
    freed = remove_temporaries([output_dir, output_dir / "checkpoints", output_dir / "samples",
                                backups_folder(output_dir)])
    if overwrite:
        cleared = clear_previous_run(output_dir)
        if cleared:
            callbacks.on_status("output.overwrite: removed the previous run's "
                                + ", ".join(cleared))
    if freed:
        callbacks.on_status(f"removed partly written saves of an interrupted run "
                            f"({freed / 2**20:,.1f} MB freed)")


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


def resume_run(run: Run, resume: ResumePoint) -> None:
    """Load the backup into the freshly built run (weights, optimizer, schedule, states)."""
    run.callbacks.on_status(f"resuming from {resume.folder} (step {resume.step})")
    _, states = load_states(resume.folder)
    run.load_state_dict(states)
    apply_changed_learning_rates(run)
    run.last_backup_step = run.step


def bucket_record(target_sizes: list[tuple[int, int]], batches) -> dict:
    """run.json's `buckets` section: items per bucket and this rank's batches per epoch."""
    return {"sizes": bucket_counts(target_sizes), "batches_per_epoch": len(batches),
            "short_batches_per_epoch": batches.short_batches()}


def caption_rules(config) -> list[CaptionRules]:
    """Each dataset's caption rules (modules/data/captions.py), by its place in the list."""
    return [CaptionRules(ds.caption_prefix, ds.caption_suffix, ds.shuffle_tags, ds.keep_tags,
                         ds.tag_dropout) for ds in config.data.datasets]


def build_dataset(prepared: PreparedRun, callbacks: TrainerCallbacks,
                  should_stop: Callable[[], bool] = lambda: False) -> ImageCaptionDataset:
    """The training dataset, with latents encoded into the on-disk cache first when enabled.

    With `data.aspect_buckets` each item gets the bucket nearest its aspect ratio, from the
    size the scan read.
    """
    config = prepared.config
    items = expand_repeats(prepared.scan)
    target_sizes = (assign_buckets(items, config.data.resolution, config.data.bucket_max_aspect)
                    if config.data.aspect_buckets else None)
    dataset = ImageCaptionDataset(items, resolution=config.data.resolution,
                                  center_crop=config.data.center_crop,
                                  random_flip=config.data.random_flip, seed=config.training.seed,
                                  target_sizes=target_sizes, caption_rules=caption_rules(config))
    if not config.data.cache_latents:
        return dataset
    from modules.train.latents import cached_latent_dataset
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
