"""What a run writes besides its backups, as small functions over the run's data (`Run`):
samples, weights (checkpoints/, final/), TensorBoard's curves, and the end-of-run summary of
several processes. The recipe (train/recipe/recipe.py) calls them when they are due."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import torch
from PIL import Image

from modules.compile import COMPONENTS as COMPILE_COMPONENTS
from modules.config.optimizers import OPTIMIZERS
from modules.events import TrainerCommands
from modules.train.recipe.builders import optimizer_scalars
from modules.train.outputs.checkpoints import checkpoints_folder, rotate_checkpoints
from modules.train.recipe.distributed import local_tensor, parameter_checksum
from modules.train.memory.memory_plan import optimizer_state_bytes, tensor_bytes
from modules.train.state.resume_offer import saved_step
from modules.train.state.run import Run
from modules.train.outputs.main_writes import agreed_write
from modules.train.outputs.sampling import sample_images, write_sample
from modules.train.outputs.metrics import start_wandb
from modules.train.outputs.saving import save_weights
from modules.models.bundle import ModelBundle
from modules.util.disk import guarded_write


@runtime_checkable
class ScheduleFree(Protocol):
    """A schedule-free optimizer (OptimizerRow.schedule_free): `eval()` swaps its averaged
    weights in, `train()` its training ones."""

    def eval(self) -> object: ...

    def train(self) -> object: ...


def backup_bytes(run: Run) -> int:
    """About what one backup takes: trained weights, optimizer state and EMA copies."""
    weights = tensor_bytes(run.all_params())
    state = optimizer_state_bytes(run.config.training.optimizer, run.all_params())
    return weights * (2 if run.ema is not None else 1) + state


@contextlib.contextmanager
def averaged_weights(run: Run):
    """Swap the averaged weights in (for sampling and saving) and the live ones back after:
    the EMA's, or schedule-free AdamW's (its `eval()` weights). The live weights come back
    bit for bit (a copy, not `train()`'s inverse interpolation), so sampling and saving
    never change what training does next and a resumed run stays exact."""
    optimizer = run.optimizer
    if OPTIMIZERS[run.config.training.optimizer].schedule_free:
        if not isinstance(optimizer, ScheduleFree):
            raise TypeError(f"{type(optimizer).__name__} is listed as schedule-free but has no "
                            "eval() / train()")
        live = [p.detach().clone() for p in run.all_params()]
        optimizer.eval()
        try:
            yield
        finally:
            optimizer.train()
            with torch.no_grad():
                for param, saved in zip(run.all_params(), live):
                    param.copy_(saved)
        return
    if run.ema is None:
        yield
        return
    run.ema.store(run.all_params())
    run.ema.copy_to(run.all_params())
    try:
        yield
    finally:
        run.ema.restore(run.all_params())


def log_scalars(run: Run, loss: float, smoothed: float, grad_norm: float, step_seconds: float,
                images: int) -> None:
    """TensorBoard's and W&B's curves of a step (loss, LR, the gradients' norm before
    clipping, seconds per optimizer step and images per second), and what the optimizer
    reports (Prodigy's d) in run.json. A norm that is not finite (an fp16 step the
    GradScaler skips) is left out of its curve."""
    scalars = optimizer_scalars(run.config, run.optimizer)
    if scalars:
        run.record.data["optimizer"] = {"name": run.config.training.optimizer.value,
                                        "step": run.step, **scalars}
    if run.writer:
        run.writer.add_scalar("loss/step", loss, run.step)
        run.writer.add_scalar("loss/smoothed", smoothed, run.step)
        run.writer.add_scalar("lr", run.current_lr(), run.step)
        if math.isfinite(grad_norm):
            run.writer.add_scalar("grad_norm", grad_norm, run.step)
        if step_seconds > 0:
            run.writer.add_scalar("time/step_seconds", step_seconds, run.step)
            run.writer.add_scalar("time/images_per_second", images / step_seconds, run.step)
        for name, value in scalars.items():
            run.writer.add_scalar(f"optimizer/{name}", value, run.step)


def start_wandb_logging(run: Run) -> None:
    """Add the W&B run to the run's logging (continuing the one a resumed backup names), keep
    its id in the state a backup saves, and say where it is in run.json and the log."""
    wandb_run = start_wandb(run.config, run.record.data, run.state.wandb_run_id)
    continued = run.state.wandb_run_id == wandb_run.id
    run.writer.wandb_run = wandb_run
    run.state.wandb_run_id = wandb_run.id
    logging = run.config.logging
    run.record.write(wandb={"run_id": wandb_run.id, "project": logging.wandb_project,
                            "entity": logging.wandb_entity, "mode": logging.wandb_mode.value,
                            "dir": str(run.output_dir / "wandb"), "continued": continued})
    run.callbacks.on_status(f"W&B run {wandb_run.id} ({logging.wandb_mode.value}, project "
                            f"{logging.wandb_project}){' continued' if continued else ''}")


def distributed_summary(run: Run) -> dict:
    """World size, and whether every rank ended with the same weights and ran compiled code."""
    checksums = run.dist.gather(parameter_checksum(run.all_params()))
    ran = [name for name, r in run.guard.report().items() if r.get("compiled_code_ran")]
    ran_everywhere = {name: all(run.dist.gather(1.0 if name in ran else 0.0))
                      for name in COMPILE_COMPONENTS}
    summary: dict[str, object] = {"strategy": run.dist.strategy.value}
    if run.dist.sharded:  # what each rank holds of the trained weights
        summary["shards"] = run.dist.world_size
        summary["shard_bytes"] = run.dist.gather(float(sum(
            local_tensor(p).numel() * p.element_size() for p in run.all_params())))
    return {**summary, "world_size": run.dist.world_size, "backend": run.dist.backend,
            "data_parallel": {name: type(module).__name__
                              for name, module in run.forward.items()},
            "ranks_in_sync": max(checksums) - min(checksums) <= 1e-6 * max(1.0, abs(checksums[0])),
            "weight_checksums": checksums, "compiled_code_ran_on_all_ranks": ran_everywhere}


def sample_due(run: Run, requested: bool) -> bool:
    """A sampling pass is due after this step: asked for (Sample now, already agreed over the
    ranks by `agreed_requests`) or scheduled."""
    every = run.config.sampling.every_steps
    return requested or bool(every and run.step % every == 0)


def agreed_requests(run: Run, commands: TrainerCommands) -> tuple[bool, bool]:
    """(Sample now, Save now) as every rank must take them: each makes every rank sample
    (FSDP: all draw; DDP: all wait for rank 0's write, `agreed_write`) or save (FSDP: all
    gather the weights), so a request one rank took is every rank's, on the same step. Several
    processes look where they look for Stop (`Run.stop_requested`: every
    `STOP_CHECK_EVERY_STEPS` optimizer steps, one all-reduce of both flags), so a request
    waits for that step; one process takes them after every step."""
    if not run.dist.enabled:
        return commands.take_sample(), commands.take_save()
    if run.step % run.STOP_CHECK_EVERY_STEPS:
        return False, False  # left for the next look, not taken
    asked_sample, asked_save = run.dist.any_of(commands.take_sample(), commands.take_save())
    return asked_sample, asked_save


def agreed_stop(run: Run, should_stop: Callable[[], bool]) -> Callable[[], bool]:
    """`should_stop` as every rank must answer it when all of them draw the samples (FSDP):
    true on all as soon as one saw Stop, so no rank leaves a sharded forward the others are
    waiting in. The question is asked at the same points on every rank (between prompts and
    denoising steps), so the collective lines up."""
    if not run.dist.sharded:
        return should_stop
    return lambda: run.dist.any(should_stop())


def sample(run: Run, should_stop: Callable[[], bool] = lambda: False) -> bool:
    """Sample every prompt; `should_stop` (Stop) is asked between prompts and denoising
    steps, so a stop does not wait for the whole pass. Returns False when Stop cut the pass
    short (fewer samples than prompts were drawn).

    One process, or DDP (every rank holds the whole model): the main process alone draws
    and writes them (under DDP the others wait for how that went, `agreed_write`). FSDP:
    every rank runs the same forwards on its sharded components (each block's weights
    gathered for its own forward, as in training) with the same prompts and seeds, so every
    rank draws the same images; rank 0 alone writes and logs them, after the pass (a write
    failing in the middle of it would leave the others in a sharded forward)
    (docs/cloud.md, "Multi-GPU")."""
    run.state.last_sample_step = run.step  # on every rank: the end-of-run sample asks it
    what = f"the samples of step {run.step} in {run.output_dir / 'samples'}"
    if run.dist.sharded:
        rows = draw_samples(run, should_stop, write=False)
        agreed_write(run.dist, what, lambda: publish_samples(run, rows, write=True))
        return len(rows) == len(run.prompts)
    complete = agreed_write(run.dist, what, lambda: publish_samples(
        run, draw_samples(run, should_stop, write=True), write=False))
    return True if complete is None else complete  # None: a DDP rank that drew nothing


def draw_samples(run: Run, should_stop: Callable[[], bool], write: bool
                 ) -> list[tuple[Path, str, Image.Image]]:
    """The sample images of this step, written as they are drawn when `write`."""
    if run.dist.is_main:
        run.callbacks.on_status(f"sampling at step {run.step}")
    with averaged_weights(run), run.outside_training():
        return sample_images(run.bundle, run.config, run.prompts, run.device, run.step,
                             run.output_dir / "samples", agreed_stop(run, should_stop),
                             run.text_cache, write=write)


def publish_samples(run: Run, rows: list[tuple[Path, str, Image.Image]], write: bool) -> bool:
    """Rank 0: write the drawn samples (when `write`: not written as they were drawn), list
    them in run.json, hand them to the front end and TensorBoard. Returns whether the pass
    was complete."""
    if len(rows) < len(run.prompts):
        run.callbacks.on_status(f"sampling at step {run.step} cut short by Stop "
                                f"({len(rows)} of {len(run.prompts)} samples written)")
    for i, (path, prompt, image) in enumerate(rows):
        if write:
            write_sample(path, image)
        run.record.add_file(path)
        run.callbacks.on_sample(path, prompt, run.step)
        if run.writer:
            import numpy as np
            run.writer.add_image(f"sample/{i}", np.asarray(image.convert("RGB")), run.step,
                                 caption=prompt)
    return len(rows) == len(run.prompts)


def save_checkpoint(run: Run, name: str) -> None:
    """Save checkpoints/<name>/ (the weights at this step), then remove the oldest ones beyond
    `output.keep_checkpoints`; run.json lists each kept checkpoint with its step and epoch.
    Every rank calls it (FSDP: all gather the weights; the outcome of rank 0's write is
    agreed by all)."""
    save_weights_into(run, checkpoints_folder(run.output_dir) / name,
                      then=lambda: list_checkpoint(run, name))


def list_checkpoint(run: Run, name: str) -> None:
    """Rank 0, after checkpoints/<name>/ was written: rotate the old ones out and list the
    kept ones in run.json."""
    listed = dict(run.record.data.get("checkpoints", {}))
    listed[name] = {"step": run.step, "epoch": run.state.epoch + 1}
    removed = rotate_checkpoints(run.output_dir, run.config.output.keep_checkpoints, run.step)
    for folder in removed:
        listed.pop(folder.name, None)
        run.record.files[:] = [f for f in run.record.files
                               if not Path(f).is_relative_to(folder)]
    if removed:
        names = ", ".join(folder.name for folder in removed)
        run.callbacks.on_status(f"removed older checkpoints ({names}): "
                                f"output.keep_checkpoints is {run.config.output.keep_checkpoints}")
    run.record.write(checkpoints=dict(sorted(listed.items(), key=lambda kv: kv[1]["step"])),
                     checkpoints_removed=[*run.record.data.get("checkpoints_removed", []),
                                          *(folder.name for folder in removed)])


def save_final(run: Run) -> bool:
    """Save final/, unless this is a resumed segment and final/ already holds weights of a
    later step (a finished run continued from an older backup, then stopped): those are
    kept, and the status and run.json say so. Returns whether final/ was written. Every rank
    calls it; rank 0's decision to keep final/ is every rank's (FSDP: none gathers alone)."""
    folder = run.output_dir / "final"
    kept: int | None = None
    if run.dist.is_main and run.config.training.resume_from:
        kept = saved_step(folder)  # an unreadable marker raises: never replace blindly
        kept = kept if kept is not None and kept > run.step else None
        if kept is not None:
            message = (f"final/ holds the weights of step {kept}, later than this segment's "
                       f"step {run.step}: final/ was kept, not replaced (this segment's "
                       "state is in its newest backup)")
            run.callbacks.on_status(message)
            run.record.write(final_kept={"final_step": kept, "segment_step": run.step,
                                         "reason": message})
    if run.config.training.resume_from and run.dist.from_main(kept) is not None:
        return False
    save_weights_into(run, folder)
    return True


def save_weights_into(run: Run, folder: Path, then: Callable[[], None] = lambda: None) -> None:
    """Save the (averaged) weights into `folder` (the main process only), listed in run.json,
    then `then()` (the main process). Sharded (FSDP) weights are gathered whole first, which
    every process takes part in. Every rank calls it: under several processes the outcome of
    rank 0's write is agreed by all (`agreed_write`), so a failed save stops every rank."""
    what = f"{folder.name}/ in {folder.parent}"
    if not run.dist.is_main and not run.dist.sharded:  # DDP: rank 0 alone saves
        agreed_write(run.dist, what, lambda: None)  # its outcome, as rank 0 had it
        return
    if run.dist.is_main:
        run.callbacks.on_status(f"saving {folder.name} at step {run.step}")
    with averaged_weights(run):
        bundle = gathered_bundle(run)  # FSDP: a collective
        agreed_write(run.dist, what, lambda: write_weights(run, bundle, folder, then))


def write_weights(run: Run, bundle: ModelBundle, folder: Path, then: Callable[[], None]) -> None:
    """Rank 0's part of `save_weights_into`: the files, run.json's list, the front end."""
    written = guarded_write(lambda: save_weights(bundle, run.config, folder, run.step,
                                                 run.file_metadata,
                                                 warn=run.callbacks.on_status),
                            folder, backup_bytes(run))
    for path in written:
        run.record.add_file(path)
    run.record.write(step=run.step)
    run.callbacks.on_saved(folder, run.step)
    then()


def gathered_bundle(run: Run) -> ModelBundle:
    """The bundle with whole weights: itself, or under FSDP (on rank 0) a copy whose sharded
    components are rebuilt on the CPU from their gathered full state dict (every rank takes
    part in the gathering; the other ranks get the bundle back as it is). The copy costs one
    whole component in CPU memory while it is saved."""
    if not run.dist.sharded:
        return run.bundle
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    whole: dict[str, Any] = {}  # diffusers' ModelMixin or transformers' PreTrainedModel
    for name, module in run.bundle.components().items():
        if not isinstance(module, FSDPModule):
            continue
        state = get_model_state_dict(cast(torch.nn.Module, module), options=options)  # collective
        if run.dist.is_main:
            whole[name] = unsharded_copy(cast(torch.nn.Module, module), state)
    if not run.dist.is_main:
        return run.bundle
    denoiser = whole.pop(run.bundle.denoiser_name, run.bundle.denoiser)
    encoders = {name: whole.get(name, encoder)
                for name, encoder in run.bundle.text_encoders.items()}
    return dataclasses.replace(run.bundle, denoiser=denoiser, text_encoders=encoders)


def unsharded_copy(module: torch.nn.Module, state: dict[str, Any]) -> torch.nn.Module:
    """A plain (unsharded) module of `module`'s own class, built from its config on the CPU,
    holding `state` (its tensors assigned, so each keeps the dtype it was trained at)."""
    from torch.distributed.fsdp import FSDPModule
    cls: Any = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    config = getattr(module, "config")
    copy = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    copy.load_state_dict(state, assign=True)
    return copy.eval()
