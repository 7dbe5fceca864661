"""The training run: prepare (validate, load; nothing written), then the loop, top to bottom."""
from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from modules.config.problems import ConfigError
from modules.config.schema import Config
from modules.events import NullCallbacks, Progress, TrainerCallbacks, TrainerCommands
from modules.train.objectives import diffusion_mse, drop_captions, min_snr_weights, offset_noise
from modules.train.distributed import init_distributed
from modules.train.prepare import PreparedRun, prepare_run
from modules.train.run import Run, start_run
from modules.train.builders import Draws, draw_randomness, latent_shape
from modules.util.errors import describe, is_out_of_memory

OUT_OF_MEMORY_ADVICE = ("lower training.batch_size or data.resolution, turn on "
                        "training.gradient_checkpointing, train LORA instead of FINE_TUNE, or "
                        "use less precision (training.mixed_precision, model.weight_dtype)")


class TrainingError(Exception):
    """Training failed after it started; files saved before the failure are intact."""


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
    run = start_run(prepared, callbacks, dist)
    try:
        return training_loop(run, callbacks, commands)
    except ConfigError:
        raise
    except Exception as exc:
        message = failure_message(exc, run.step)
        run.record.write(status="failed", error=message)
        callbacks.on_error(message)
        raise TrainingError(message) from exc
    finally:
        run.close()


def failure_message(exc: Exception, step: int) -> str:
    """One line for a failed run; out of memory says what to change."""
    if is_out_of_memory(exc):
        return f"out of memory at step {step} ({describe(exc)}): {OUT_OF_MEMORY_ADVICE}"
    return f"training failed at step {step}: {describe(exc)}"


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

    Returns the loss as a tensor on the device: reading it (a host sync) waits for the
    optimizer step, so CUDA graphs and asynchronous kernels are not stalled every micro-step.
    """
    bundle, device, t = run.bundle, run.device, run.config.training
    scheduler = bundle.noise_scheduler
    with run.autocast():
        with torch.no_grad():
            latents = run.encode_latents(batch, draws.vae_eps)
        noise = offset_noise(draws.noise.to(device, latents.dtype), draws.noise_offset,
                             t.noise_offset)
        timesteps = draws.timesteps.to(device)
        noisy = scheduler.add_noise(latents, noise, timesteps)
        captions = drop_captions(batch["caption"], draws.caption_dropout,
                                 run.config.data.caption_dropout)
        with torch.set_grad_enabled(run.trains_text_encoder):
            hidden, added = run.encode_captions(batch, captions)
        prediction = run.unet(run.varying_shape(noisy, "unet"), timesteps, hidden,
                              added_cond_kwargs=added).sample
        if bundle.prediction_type == "v_prediction":
            target = scheduler.get_velocity(latents, noise, timesteps)
        else:
            target = noise
        weights = (min_snr_weights(scheduler.alphas_cumprod, timesteps, t.min_snr_gamma,
                                   bundle.prediction_type) if t.min_snr_gamma else None)
        loss = diffusion_mse(prediction, target, weights)
    run.backward(loss / t.gradient_accumulation)
    return loss.detach()


def training_loop(run: Run, callbacks: TrainerCallbacks, commands: TrainerCommands) -> RunResult:
    """The loop: draw noise, guarded micro-step, optimizer step, log, sample, save, poll commands."""
    config, state = run.config, run.state
    window = None
    step_started = time.perf_counter()
    callbacks.on_status(f"training {run.budget.total_steps} steps on {run.device.type}")

    for index, batch, closes_window in batches(run, commands):
        pixel_shape = run.pixel_shape(batch)
        draws = draw_randomness(state.generator, latent_shape(run.bundle.vae, *pixel_shape),
                                run.bundle.noise_scheduler.config.num_train_timesteps,
                                need_vae_eps="latents" not in batch)
        if window is None:  # a compile failure replays the whole window
            window = run.guard.window()
        with run.gradient_sync(closes_window):
            window.run(functools.partial(micro_step, run, batch, draws),
                       new_shape=run.shape_log.is_new(pixel_shape))
        run.shape_log.add(pixel_shape, run.recompiles)
        if not closes_window:
            continue

        run.optimizer_step()
        state.step += 1
        state.batches_done = index + 1
        loss = run.dist.mean(window_mean(window.results))  # the step's one host sync
        window = None
        elapsed = time.perf_counter() - step_started
        run.record.losses.append(loss)
        run.record.step_seconds.append(elapsed)
        smooth = state.smoothed.update(loss)
        callbacks.on_progress(progress_event(run, loss, smooth))
        run.log_scalars(loss, smooth)

        every_sample = config.sampling.every_steps
        if commands.take_sample() or (every_sample and run.step % every_sample == 0):
            run.sample()
        every_save = config.output.save_every_steps
        if commands.take_save() or (every_save and run.step % every_save == 0
                                    and run.step < run.budget.total_steps):
            run.save_checkpoint(f"step-{run.step:06d}")
        step_started = time.perf_counter()

    status = "stopped" if run.dist.any(commands.stop_requested) else "finished"
    callbacks.on_status(f"{status} after {run.step} steps; saving")
    run.save_final()
    if config.sampling.prompts and status == "finished" and state.last_sample_step != run.step:
        run.sample()
    run.record.write(status=status, compile=run.guard.report(),
                     batch_shapes=run.shape_log.report(run.recompiles()),
                     distributed=run.distributed_summary())
    callbacks.on_status(f"{status}: {run.step} steps, outputs in {run.output_dir}")
    return RunResult(status, run.step, run.output_dir, dict(run.record.data))


def window_mean(losses: list[torch.Tensor]) -> float:
    """The mean loss of an accumulation window's micro-steps, read from the device once."""
    return float(torch.stack(losses).float().mean().item())


def progress_event(run: Run, loss: float, smoothed_loss: float) -> Progress:
    times = run.record.step_seconds[1:] or run.record.step_seconds
    per_step = sorted(times)[len(times) // 2]
    remaining = run.budget.total_steps - run.step
    return Progress(step=run.step, max_steps=run.budget.total_steps, epoch=run.state.epoch + 1,
                    max_epochs=run.budget.epochs, loss=loss, smoothed_loss=smoothed_loss,
                    lr=run.current_lr(), seconds_per_step=per_step,
                    eta_seconds=per_step * remaining)
