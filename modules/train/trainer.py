"""The training run: prepare (validate, load; nothing written), then the loop, top to bottom."""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from modules.config.problems import ConfigError
from modules.config.schema import Config, MixedPrecision
from modules.events import (NullCallbacks, Progress, StopRequested, TrainerCallbacks,
                            TrainerCommands)
from modules.train.objectives import diffusion_mse, drop_captions, offset_noise
from modules.train.distributed import init_distributed
from modules.train.eta import estimated_sample_seconds, eta_seconds, samples_still_due
from modules.train.history import record_compile_time
from modules.train.prepare import PreparedRun, prepare_run
from modules.train.backup_files import list_backups
from modules.train.record import peak_memory
from modules.train.run import Run
from modules.train.start import start_run
from modules.train.builders import Draws, draw_randomness, latent_shape
from modules.util.disk import DiskFull
from modules.util.errors import describe, is_out_of_memory

OUT_OF_MEMORY_ADVICE = ("lower training.batch_size or data.resolution, turn on "
                        "training.gradient_checkpointing, train LORA instead of FINE_TUNE, or "
                        "use less precision (training.mixed_precision, model.weight_dtype)")


class TrainingError(Exception):
    """Training failed after it started; files saved before the failure are intact."""


class NonFiniteTraining(Exception):
    """Too many optimizer steps in a row had a NaN/inf loss or gradients (all were skipped)."""


@dataclass
class RunResult:
    status: str  # finished | stopped
    steps: int
    output_dir: Path
    record: dict


def train(config: Config, callbacks: TrainerCallbacks | None = None,
          commands: TrainerCommands | None = None) -> RunResult:
    """Validate, prepare and run one training; raise ConfigError before anything is written."""
    commands = commands or TrainerCommands()
    dist = init_distributed(config.general.device)
    if not dist.is_main:  # one rank reports; the others train quietly
        callbacks = None
    callbacks = callbacks or NullCallbacks()
    with dist.main_first():  # rank 0 builds cached built-ins before the others look for them
        prepared: PreparedRun = prepare_run(config, callbacks)  # may raise ConfigError
    dist.barrier()  # every rank validated before rank 0 writes the first file
    try:
        run = start_run(prepared, callbacks, dist, commands)
    except StopRequested as stop:  # before the first step: nothing to back up or save
        steps = prepared.resume.step if prepared.resume else 0
        callbacks.on_status(f"stopped before training began ({stop}); nothing was trained, "
                            "so no backup or weights were written")
        return RunResult("stopped", steps, Path(config.output.dir), {"status": "stopped"})
    try:
        result = training_loop(run, callbacks, commands)
        if dist.is_main:  # what a front end shows as the expected compile time next time
            record_compile_time(config, run.device.type, result.record.get("compile", {}))
        return result
    except ConfigError:
        raise
    except Exception as exc:
        message = failure_message(exc, run.step) + backup_after_failure(run, exc)
        try:
            run.record.write(status="failed", error=message,
                             memory=peak_memory(run.device.type == "cuda"))
        except OSError as record_exc:  # a full disk: the message still reaches the user
            message += f"; run.json could not be updated ({describe(record_exc)})"
        callbacks.on_error(message)
        raise TrainingError(message) from exc
    finally:
        run.close()


def failure_message(exc: Exception, step: int) -> str:
    """One line for a failed run; out of memory and a full disk say what to change."""
    if is_out_of_memory(exc):
        return f"out of memory at step {step} ({describe(exc)}): {OUT_OF_MEMORY_ADVICE}"
    if isinstance(exc, (NonFiniteTraining, DiskFull)):
        return f"training stopped at step {step}: {exc}"
    return f"training failed at step {step}: {describe(exc)}"


def backup_after_failure(run: Run, exc: Exception) -> str:
    """Write a backup of the last good step after a failure, when one can help: not after
    non-finite steps (the last backup from before them is the one to go back to) nor when
    the disk is full. Returns what to add to the failure message."""
    if isinstance(exc, (NonFiniteTraining, DiskFull)) or run.step == 0:
        return resume_hint(run.output_dir)
    try:
        run.backup("after a failure")
    except Exception as backup_exc:  # noqa: BLE001 - reported in the failure message
        return (f"; the backup after the failure failed too ({describe(backup_exc)})"
                + resume_hint(run.output_dir))
    return resume_hint(run.output_dir)


def resume_hint(output_dir: Path) -> str:
    """The end of a stopped or failed run's message: how to resume, or that nothing can be
    (a stop before the first step, a disk full before the first backup): never a pointer to a
    backups folder that does not exist."""
    found = list_backups(output_dir)
    if not found:
        return "; nothing to resume (no backup was written)"
    step, folder = found[-1]
    return f"; resume with --resume latest (newest backup: step {step}, {folder})"


def batches(run: Run, commands: TrainerCommands) -> Iterator[tuple[int, dict, bool]]:
    """(index in epoch, batch, closes_accumulation_window) until the step budget is used or Stop.

    Starts where `run.state` says (a resumed run skips the batches it already trained). Stop
    is looked at when a window starts, so a stopped run never leaves half a window's gradients
    behind.
    """
    accumulation = run.config.training.gradient_accumulation
    state = run.state
    while state.epoch < run.budget.epochs:
        loader = run.loader_for_epoch(state.epoch, skip_batches=state.batches_done)
        in_epoch = state.batches_done + len(loader)
        for i, batch in enumerate(loader, start=state.batches_done):
            if i % accumulation == 0 and run.stop_requested(commands):
                return
            closes = (i + 1) % accumulation == 0 or i + 1 == in_epoch
            yield i, batch, closes
            if closes and run.step >= run.budget.total_steps:
                return
        state.epoch += 1
        state.batches_done = 0


def micro_step(run: Run, batch: dict, draws: Draws) -> torch.Tensor:
    """One forward + backward on a batch: encode, noise, predict, loss, backward.

    What differs between model families (the noise and the target, the conditioning, how the
    denoiser is called) is asked of `run.family`. Returns the loss as a tensor on the device:
    reading it (a host sync) waits for the optimizer step, so CUDA graphs and asynchronous
    kernels are not stalled every micro-step.
    """
    objective, device, t = run.family.objective, run.device, run.config.training
    with run.autocast():
        with torch.no_grad():
            latents = run.encode_latents(batch, draws.vae_eps)
        noise = offset_noise(draws.noise.to(device, latents.dtype), draws.noise_offset,
                             t.noise_offset)
        timesteps = draws.timesteps.to(device)
        noisy, target = objective.noisy_and_target(run.bundle, latents, noise, timesteps)
        captions = drop_captions(batch["caption"], draws.caption_dropout,
                                 run.config.data.caption_dropout)
        with torch.set_grad_enabled(run.trains_text_encoder):
            conditioning = run.encode_captions(batch, captions)
        prediction = run.predict(noisy, timesteps, conditioning)
        weights = objective.loss_weights(run.bundle, timesteps, t.min_snr_gamma)
        loss = diffusion_mse(prediction, target, weights)
    run.backward(loss / t.gradient_accumulation)
    return loss.detach()


def training_loop(run: Run, callbacks: TrainerCallbacks, commands: TrainerCommands) -> RunResult:
    """The loop: draw noise, guarded micro-step, optimizer step, log, sample, save, poll commands."""
    config, state = run.config, run.state
    window = None
    step_started = time.perf_counter()
    sample_seconds: float | None = None  # the last sampling pass, for the ETA
    callbacks.on_status(f"training {run.budget.total_steps} steps on {run.device.type}"
                        + (f", from step {run.step}" if run.step else ""))

    for index, batch, closes_window in batches(run, commands):
        pixel_shape = run.pixel_shape(batch)
        if window is None:  # the first micro-batch of an optimizer step
            state.reseed_draws(config.training.seed, run.dist.rank)
        draws = draw_randomness(state.generator, latent_shape(run.bundle.vae, *pixel_shape),
                                run.family.objective.train_timesteps(run.bundle),
                                need_vae_eps="latents" not in batch)
        if window is None:  # a compile failure replays the whole window
            window = run.guard.window()
        with run.gradient_sync(closes_window):
            window.run(functools.partial(micro_step, run, batch, draws), shape=pixel_shape)
        run.shape_log.add(pixel_shape, run.recompiles)
        if not closes_window:
            continue

        loss, finite = read_step(run, window.results, run.gradient_norm())  # one host sync
        run.optimizer_step(finite)
        state.step += 1
        state.batches_done = index + 1
        window = None
        run.record.step_seconds.append(time.perf_counter() - step_started)
        if finite:
            state.bad_steps = 0
            run.record.losses.append(loss)
            smooth = state.smoothed.update(loss)
            callbacks.on_progress(progress_event(run, loss, smooth, sample_seconds))
            run.log_scalars(loss, smooth)
        else:
            skip_non_finite_step(run, loss)

        every_sample = config.sampling.every_steps
        if commands.take_sample() or (every_sample and run.step % every_sample == 0):
            sample_started = time.perf_counter()
            run.sample(lambda: commands.stop_requested)
            sample_seconds = time.perf_counter() - sample_started
        every_save = config.output.save_every_steps
        if commands.take_save() or (every_save and run.step % every_save == 0
                                    and run.step < run.budget.total_steps):
            run.save_checkpoint(f"step-{run.step:06d}")
        run.mark_boundary()
        if run.backup_due():
            run.backup("scheduled")
        step_started = time.perf_counter()

    status = "stopped" if run.dist.any(commands.stop_requested) else "finished"
    callbacks.on_status(f"{status} after {run.step} steps; saving")
    if status == "stopped":
        run.backup("stopped")
    if run.step > 0:
        run.save_final()
    else:  # stopped before the first optimizer step: "final" weights would be the base model
        callbacks.on_status("stopped before the first optimizer step: no weights saved")
        run.record.write(final="not saved: stopped before the first optimizer step")
    if run.prompts and status == "finished" and state.last_sample_step != run.step:
        run.sample(lambda: commands.stop_requested)
    run.record.write(status=status, compile=run.guard.report(),
                     skipped_steps=state.skipped_steps,
                     batch_shapes=run.shape_log.report(run.recompiles()),
                     distributed=run.distributed_summary(),
                     memory=peak_memory(run.device.type == "cuda"))
    hint = resume_hint(run.output_dir) if status == "stopped" else ""
    callbacks.on_status(f"{status}: {run.step} steps, outputs in {run.output_dir}{hint}")
    return RunResult(status, run.step, run.output_dir, dict(run.record.data))


def read_step(run: Run, losses: list[torch.Tensor], grad_norm: torch.Tensor) -> tuple[float, bool]:
    """The window's mean loss (over every process) and whether loss and gradients are finite,
    read from the device together: the step's one host sync."""
    loss_mean = torch.stack(losses).float().mean()
    loss, norm = torch.stack([loss_mean, grad_norm.float().to(loss_mean.device)]).tolist()
    loss = run.dist.mean(loss)
    finite = math.isfinite(loss) and (run.scaler is not None or math.isfinite(norm))
    return loss, finite


def skip_non_finite_step(run: Run, loss: float) -> None:
    """Count a skipped step; too many in a row stop the run (no weight was changed by them)."""
    state, t = run.state, run.config.training
    state.bad_steps += 1
    state.skipped_steps += 1
    run.record.losses.append(None)
    run.callbacks.on_status(f"step {run.step}: loss {loss} or its gradients are not finite; "
                            f"the step was skipped ({state.bad_steps} in a row)")
    if state.bad_steps < t.max_bad_steps:
        return
    cause = ("fp16 overflow: use BF16 mixed precision, or a lower learning rate"
             if t.mixed_precision == MixedPrecision.FP16 or
             t.mixed_precision == MixedPrecision.NO and run.compute_dtype == torch.float16
             else f"the learning rate ({t.learning_rate:g}) is probably too high")
    raise NonFiniteTraining(f"{state.bad_steps} steps in a row (up to step {run.step}) had a "
                            f"non-finite loss or gradients ({cause}); no weights were changed "
                            "by them and nothing non-finite was saved")


def progress_event(run: Run, loss: float, smoothed_loss: float,
                   sample_seconds: float | None = None) -> Progress:
    """Progress after a step; the ETA counts the sampling passes still to come, at the last
    pass's measured duration (`sample_seconds`) or an estimate before the first."""
    times = run.record.step_seconds[1:] or run.record.step_seconds
    per_step = sorted(times)[len(times) // 2]
    config, total = run.config, run.budget.total_steps
    due = samples_still_due(run.step, total, config.sampling.every_steps,
                            len(run.prompts))
    per_sample = (sample_seconds if sample_seconds is not None
                  else estimated_sample_seconds(config, per_step))
    eta, sampling = eta_seconds(total - run.step, per_step, due, per_sample)
    return Progress(step=run.step, max_steps=total, epoch=run.state.epoch + 1,
                    max_epochs=run.budget.epochs, loss=loss, smoothed_loss=smoothed_loss,
                    lr=run.current_lr(), seconds_per_step=per_step,
                    eta_seconds=eta, sampling_eta_seconds=sampling)
