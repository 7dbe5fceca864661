"""One training run as a recipe read top to bottom (the shape of torchtune's single-device LoRA
recipe): `setup` builds everything the run needs from the prepared run, `train_step` is one
optimizer step, `train` is the loop, `save_backup` / `load_backup` write and read the run's
state, `close` lets go of what the run holds.

The run's state is typed data: `Run` (train/run.py) with one `state_dict` / `load_state_dict`
pair. One optimizer step passes through four files: this one (`train_step`, `micro_step` and
the small helpers below it), the model family (models/families/: conditioning, noise and
target, the denoiser's call), the objective and step helpers (train/objectives.py,
train/builders.py) and the guarded compile window (compile/guarded.py).
"""
from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from modules.config.prompts import sample_prompts
from modules.config.schema import MixedPrecision
from modules.data.buckets import describe_buckets
from modules.data.dataset import epoch_batch_sampler
from modules.events import Progress, StopRequested, TrainerCallbacks, TrainerCommands
from modules.train.adapters import seed_adapter_dropout
from modules.train.backup import (BoundaryState, NonFiniteBackup, ResumePoint, backups_folder,
                                  load_states, save_backup)
from modules.train.builders import (Draws, autocast_context, build_lr_scheduler,
                                    build_optimizer, draw_randomness, float32_precision,
                                    latent_shape, step_budget)
from modules.train.checkpoints import due_checkpoint
from modules.models.model_hash import base_model_hashes
from modules.paths import cache_dir_for
from modules.train.data_metadata import training_data_metadata
from modules.train.compile_guard import COMPILE_DENOISER, build_compile_guard
from modules.train.distributed import Distributed
from modules.train.eta import estimated_sample_seconds, eta_seconds, samples_still_due
from modules.train.objectives import (caption_dropouts, diffusion_mse, drop_captions,
                                      offset_noise, sample_weights)
from modules.train.output_lock import OutputLock
from modules.train.outputs import (backup_bytes, distributed_summary, log_scalars, sample,
                                   save_checkpoint, save_final)
from modules.train.prepare import PreparedRun
from modules.train.record import peak_memory
from modules.train.run import Run, item_buckets
from modules.train.start import (apply_changed_learning_rates, bucket_record, build_dataset,
                                 build_ema, prepare_output_folder, resume_hint, start_record,
                                 take_output_lock, tensorboard_writer, text_encoder_cache)
from modules.train.state import TrainingState, draws_generator
from modules.train.weights import (apply_denoiser_memory_format, enable_gradient_checkpointing,
                                   prepare_trainable, trained_components)
from modules.util.disk import guarded_write


MicroBatch = tuple[int, dict, bool]  # (index in the epoch, batch, closes the window)


class NonFiniteTraining(Exception):
    """Too many optimizer steps in a row had a NaN/inf loss or gradients (all were skipped)."""


@dataclass
class RunResult:
    status: str  # finished | stopped
    steps: int
    output_dir: Path
    record: dict


class TrainingRecipe:
    """One run: setup → train (train_step after train_step) → close; backups on the way."""

    def __init__(self, prepared: PreparedRun, callbacks: TrainerCallbacks, dist: Distributed,
                 commands: TrainerCommands) -> None:
        self.prepared, self.callbacks, self.dist, self.commands = (prepared, callbacks, dist,
                                                                   commands)
        self.run: Run | None = None  # the run's objects and state, once `setup` built them

    # ------------------------------------------------------------------------------ setup
    def setup(self) -> Run:
        """Create the output folder and everything the loop needs; the first write happens
        here. The output folder's lock is let go again if building the run fails. A Stop
        during latent caching raises StopRequested, with run.json saying `stopped`."""
        lock = (take_output_lock(Path(self.prepared.config.output.dir), self.callbacks)
                if self.dist.is_main else None)
        try:
            self.run = self._build(lock)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        return self.run

    def _build(self, lock: OutputLock | None) -> Run:
        """`setup`'s body, in the order the run depends on: the record first, the weights on
        the device before the latent cache, compile before the DDP wrap, the state last."""
        prepared, callbacks, dist, commands = (self.prepared, self.callbacks, self.dist,
                                               self.commands)
        config, bundle = prepared.config, prepared.bundle
        device = dist.device or prepared.device
        record = prepare_output_folder(prepared, callbacks, dist.is_main)
        start_record(record, prepared, device)

        # the trained weights (LoRA init draws from the global generator)
        torch.manual_seed(config.training.seed)
        trained = trained_components(config)
        params = prepare_trainable(bundle, config)
        if config.training.gradient_checkpointing:
            enable_gradient_checkpointing(bundle, trained)
        for module in bundle.components().values():
            module.to(device)
        apply_denoiser_memory_format(bundle, config)

        # the data, and the step budget counted on the one batch sampler training uses
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
                                f"{len(batches)} batches per epoch, "
                                f"{batches.short_batches()} short")

        # optimizer, precision, compile (then the DDP wrap), EMA, text cache, TensorBoard
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
        forward = dist.wrap_trained({name: components[name] for name in trained})
        run = Run(config, bundle, device, Path(config.output.dir), record, callbacks, dataset,
                  batches, params, optimizer,
                  build_lr_scheduler(config, optimizer, budget.total_steps), budget, guard, dist,
                  TrainingState(generator=draws_generator(config.training.seed, dist.rank)),
                  scaler=scaler, writer=tensorboard_writer(config, dist.is_main),
                  trained=trained, ema=build_ema(config, params),
                  text_cache=text_encoder_cache(config, bundle, device, callbacks),
                  forward=forward, restore_precision=restore_precision, lock=lock,
                  prompts=sample_prompts(config)[0])  # check_inputs read them already
        run.file_metadata = {**training_data_metadata(prepared.scan, config),
                             **base_model_hashes(config.model.path,
                                                 cache_dir_for(config.general.cache_dir))}
        if prepared.resume is not None:
            self.load_backup(run, prepared.resume)
        mark_boundary(run)
        return run

    # -------------------------------------------------------------------------- one step
    def train_step(self, micro_batches: Iterator[MicroBatch]) -> tuple[float, bool] | None:
        """One optimizer step: the accumulation window's micro-steps, each run inside the
        compile window (a compile failure replays the whole window with the next backend),
        then the step's one host sync and the optimizer step. Returns (loss, finite), or None
        when no micro-batch is left."""
        run = self.run
        config, state = run.config, run.state
        window = None
        for index, batch, closes_window in micro_batches:
            pixel_shape = run.pixel_shape(batch)
            if window is None:  # the first micro-batch of the step: its draws are seeded
                state.reseed_draws(config.training.seed, run.dist.rank)
                seed_adapter_dropout(config, state.step, run.dist.rank)
            draws = draw_randomness(state.generator, latent_shape(run.bundle.vae, *pixel_shape),
                                    run.family.objective.train_timesteps(run.bundle),
                                    need_vae_eps="latents" not in batch)
            if window is None:
                window = run.guard.window()
            with run.dist.gradient_sync(run.forward, closes_window):
                window.run(functools.partial(micro_step, run, batch, draws), shape=pixel_shape)
            run.shape_log.add(pixel_shape, run.recompiles)
            if closes_window:
                break
        else:
            return None
        loss, finite = read_step(run, window.results, gradient_norm(run))  # one host sync
        optimizer_step(run, finite)
        state.step += 1
        state.batches_done = index + 1
        return loss, finite

    # -------------------------------------------------------------------------- the loop
    def train(self) -> RunResult:
        """The loop: step, log, sample, save, back up, until the budget is used or Stop."""
        run, callbacks, commands = self.run, self.callbacks, self.commands
        config, state = run.config, run.state
        step_started = time.perf_counter()
        sample_seconds: float | None = None  # the last sampling pass, for the ETA
        callbacks.on_status(f"training {run.budget.total_steps} steps on {run.device.type}"
                            + (f", from step {run.step}" if run.step else ""))

        micro_batches = batches(run, commands)
        while (outcome := self.train_step(micro_batches)) is not None:
            loss, finite = outcome
            run.record.step_seconds.append(time.perf_counter() - step_started)
            if finite:
                state.bad_steps = 0
                run.record.losses.append(loss)
                smooth = state.smoothed.update(loss)
                callbacks.on_progress(progress_event(run, loss, smooth, sample_seconds))
                log_scalars(run, loss, smooth)
            else:
                skip_non_finite_step(run, loss)

            every_sample = config.sampling.every_steps
            if commands.take_sample() or (every_sample and run.step % every_sample == 0):
                sample_started = time.perf_counter()
                sample(run, lambda: commands.stop_requested)
                sample_seconds = time.perf_counter() - sample_started
            if name := due_checkpoint(run.step, run.budget.total_steps, state.epoch,
                                      state.batches_done, run.budget.batches_per_epoch,
                                      config.output.save_every_steps,
                                      config.output.save_every_epochs, commands.take_save()):
                save_checkpoint(run, name)
            mark_boundary(run)
            if backup_due(run):
                self.save_backup("scheduled")
            step_started = time.perf_counter()

        status = "stopped" if run.dist.any(commands.stop_requested) else "finished"
        callbacks.on_status(f"{status} after {run.step} steps; saving")
        if status == "stopped":
            self.save_backup("stopped")
        if run.step > 0:
            save_final(run)
        else:  # stopped before the first optimizer step: "final" weights would be the base model
            callbacks.on_status("stopped before the first optimizer step: no weights saved")
            run.record.write(final="not saved: stopped before the first optimizer step")
        if run.prompts and status == "finished" and state.last_sample_step != run.step:
            sample(run, lambda: commands.stop_requested)
        feeding(run)
        run.record.write(status=status, compile=run.guard.report(),
                         skipped_steps=state.skipped_steps,
                         batch_shapes=run.shape_log.report(run.recompiles()),
                         distributed=distributed_summary(run),
                         memory=peak_memory(run.device.type == "cuda"))
        hint = resume_hint(run.output_dir) if status == "stopped" else ""
        callbacks.on_status(f"{status}: {run.step} steps, outputs in {run.output_dir}{hint}")
        return RunResult(status, run.step, run.output_dir, dict(run.record.data))

    # --------------------------------------------------------------------------- backups
    def save_backup(self, reason: str) -> Path | None:
        """Write a backup at the last step boundary (once per step; the main process only)."""
        run = self.run
        if (not run.dist.is_main or run.boundary is None
                or run.boundary.training["step"] in (0, run.last_backup_step,
                                                     run.refused_backup_step)):
            return None
        step = run.boundary.training["step"]
        run.callbacks.on_status(f"writing a backup at step {step} ({reason})")
        try:
            folder = guarded_write(lambda: save_backup(run.state_dict(run.boundary), run.config,
                                                       run.output_dir, reason),
                                   backups_folder(run.output_dir), backup_bytes(run))
        except NonFiniteBackup as exc:
            refuse_backup(run, step, reason, str(exc))
            return None
        run.last_backup_step = step
        run.last_backup_time = time.monotonic()
        run.record.write(last_backup=str(folder), last_backup_step=run.last_backup_step)
        return folder

    def load_backup(self, run: Run, resume: ResumePoint) -> None:
        """Load the backup into the freshly built run (weights, optimizer, schedule, states)."""
        run.callbacks.on_status(f"resuming from {resume.folder} (step {resume.step})")
        _, states = load_states(resume.folder)
        run.load_state_dict(states)
        apply_changed_learning_rates(run)
        run.last_backup_step = run.step

    def close(self) -> None:
        """Let go of what the run holds: the compile engine, the float32 precision settings,
        the TensorBoard writer and the output folder's lock."""
        if self.run is not None:
            self.run.close()


# ------------------------------------------------------------------ the step, beside the recipe
def micro_step(run: Run, batch: dict, draws: Draws) -> torch.Tensor:
    """One forward + backward on a batch: encode, noise, predict, loss, backward.

    What differs between model families (the noise and the target, the conditioning, how the
    denoiser is called) is asked of `run.family`. Returns the loss as a tensor on the device:
    reading it (a host sync) waits for the optimizer step, so CUDA graphs and asynchronous
    kernels are not stalled every micro-step.
    """
    family, device, t = run.family, run.device, run.config.training
    with autocast_context(run.config, device):
        with torch.no_grad():
            latents = encode_latents(run, batch, draws.vae_eps)
        noise = offset_noise(draws.noise.to(device, latents.dtype), draws.noise_offset,
                             t.noise_offset)
        timesteps = draws.timesteps.to(device)
        noisy, target = family.objective.noisy_and_target(run.bundle, latents, noise, timesteps)
        captions = drop_captions(batch["caption"], draws.caption_dropout,
                                 caption_dropouts(run.config, batch["source"]))
        with torch.set_grad_enabled(run.trains_text_encoder):
            conditioning = encode_captions(run, batch, captions)
        denoiser = run.forward.get(run.bundle.denoiser_name, run.bundle.denoiser)  # DDP or not
        prediction = family.predict(denoiser, denoiser_input(run, noisy), timesteps,
                                    conditioning)
        weights = family.objective.loss_weights(run.bundle, timesteps, t.min_snr_gamma)
        weights = sample_weights(weights, batch.get("loss_weight"))  # prior_loss_weight
        loss = diffusion_mse(prediction, target, weights, batch.get("mask"))
    scaled = loss / t.gradient_accumulation
    (run.scaler.scale(scaled) if run.scaler else scaled).backward()
    return loss.detach()


def encode_latents(run: Run, batch: dict, vae_eps: torch.Tensor | None) -> torch.Tensor:
    """Latents × scaling factor: from the cache, or the VAE posterior with pre-drawn noise."""
    vae = run.bundle.vae
    if "latents" in batch:
        return batch["latents"].to(run.device, run.compute_dtype, non_blocking=True)
    pixels = varying_shape(run, batch["pixel_values"].to(run.device, vae.dtype,
                                                         non_blocking=True), "vae")
    posterior = vae.encode(pixels).latent_dist
    latents = posterior.mean + posterior.std * vae_eps.to(run.device, posterior.mean.dtype)
    return (latents * vae.config.scaling_factor).to(run.compute_dtype)


def encode_captions(run: Run, batch: dict, captions: list[str]) -> dict:
    """The denoiser's conditioning for `captions` (the batch's, after caption dropout)."""
    if run.text_cache is not None:
        hidden, pooled = run.text_cache.encode(captions, batch.get("caption_varies"))
    else:
        hidden, pooled = run.family.encode_text(run.bundle, captions, run.device, run.forward)
    # Text encoders may be kept at another dtype than the denoiser (a fine-tuned denoiser
    # trains at model.train_dtype while frozen encoders stay at model.weight_dtype).
    hidden = hidden.to(run.compute_dtype)
    pooled = None if pooled is None else pooled.to(run.compute_dtype)
    _, height, width = run.pixel_shape(batch)
    return run.family.conditioning(hidden, pooled, batch, height, width)


def varying_shape(run: Run, tensor: torch.Tensor, component: str) -> torch.Tensor:
    """With aspect-ratio buckets the batch's size, height and width change between batches:
    under compile.dynamic AUTO the compiled component's input is marked up front, so a whole
    denoiser or VAE does not first compile static and then recompile at the second bucket
    (modules/compile/dynamic_dims.py). `component` is the compile engine's name."""
    if not run.config.data.aspect_buckets:
        return tensor
    return run.guard.mark_varying_input(component, tensor)


def denoiser_input(run: Run, noisy: torch.Tensor) -> torch.Tensor:
    """The noisy latents in the denoiser's memory layout (a channels-last denoiser's first
    convolution then reads them without a conversion), marked for varying shapes."""
    if run.config.training.channels_last:
        noisy = noisy.contiguous(memory_format=torch.channels_last)
    return varying_shape(run, noisy, COMPILE_DENOISER)


def gradient_norm(run: Run) -> torch.Tensor:
    """Unscale (fp16) and clip the gradients; return their total norm, still on the device
    (it is read with the loss, in the step's one host sync)."""
    if run.scaler:
        run.scaler.unscale_(run.optimizer)
    params = run.all_params()
    max_norm = run.config.training.max_grad_norm
    if max_norm:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def read_step(run: Run, losses: list[torch.Tensor], grad_norm: torch.Tensor) -> tuple[float, bool]:
    """The window's mean loss (over every process) and whether loss and gradients are finite,
    read from the device together: the step's one host sync."""
    loss_mean = torch.stack(losses).float().mean()
    loss, norm = torch.stack([loss_mean, grad_norm.float().to(loss_mean.device)]).tolist()
    loss = run.dist.mean(loss)
    finite = math.isfinite(loss) and (run.scaler is not None or math.isfinite(norm))
    return loss, finite


def optimizer_step(run: Run, finite: bool) -> None:
    """Step the optimizer and the LR schedule and clear the gradients. A step whose loss or
    gradients are not finite leaves the weights (and the EMA) as they were."""
    if run.scaler:
        run.scaler.step(run.optimizer)  # skips by itself when the gradients hold inf/NaN
        run.scaler.update()
    elif finite:
        run.optimizer.step()
    run.lr_scheduler.step()
    # CUDA graphs on a trained component need gradients that stay allocated (see
    # modules/compile/plan.py: cudagraph_rules); otherwise free them between steps.
    run.optimizer.zero_grad(set_to_none=not run.guard.persistent_grads)
    if run.ema is not None and finite:
        run.ema.step(run.all_params())


# ------------------------------------------------------------------ around the step (pure-ish)
def batches(run: Run, commands: TrainerCommands) -> Iterator[MicroBatch]:
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
        for i, batch in enumerate(run.feed.timed(loader), start=state.batches_done):
            if i % accumulation == 0 and run.stop_requested(commands):
                return
            closes = (i + 1) % accumulation == 0 or i + 1 == in_epoch
            yield i, batch, closes
            if closes and run.step >= run.budget.total_steps:
                return
        state.epoch += 1
        state.batches_done = 0


def feeding(run: Run) -> None:
    """How long the steps waited for their batches, in run.json, and a hint in the status
    when it was long enough to matter (the first step, compile included, is left out)."""
    seconds = sum(run.record.step_seconds[1:])
    workers, cached = run.config.data.workers, run.config.data.cache_latents
    run.record.write(data_loading=run.feed.report(seconds, workers,
                                                  pin_memory=run.device.type == "cuda"))
    hint = run.feed.hint(seconds, workers, cached)
    if hint:
        run.callbacks.on_status(hint)


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
    due = samples_still_due(run.step, total, config.sampling.every_steps, len(run.prompts))
    per_sample = (sample_seconds if sample_seconds is not None
                  else estimated_sample_seconds(config, per_step))
    eta, sampling = eta_seconds(total - run.step, per_step, due, per_sample)
    return Progress(step=run.step, max_steps=total, epoch=run.state.epoch + 1,
                    max_epochs=run.budget.epochs, loss=loss, smoothed_loss=smoothed_loss,
                    lr=run.current_lr(), seconds_per_step=per_step,
                    eta_seconds=eta, sampling_eta_seconds=sampling)


def mark_boundary(run: Run) -> None:
    """Remember the small states as they are now, between two optimizer steps (what a backup
    written later, even after a failure mid-window, saves)."""
    run.boundary = BoundaryState.capture(run.state.state_dict())


def backup_due(run: Run) -> bool:
    """A scheduled backup is due (by steps or minutes), not at the last step and not while
    steps are being skipped as non-finite (the backups from before that are the ones to keep)."""
    out = run.config.output
    by_steps = out.backup_every_steps and run.step % out.backup_every_steps == 0
    by_time = (out.backup_every_minutes
               and time.monotonic() - run.last_backup_time >= 60 * out.backup_every_minutes)
    return (bool(by_steps or by_time) and run.step < run.budget.total_steps
            and run.state.bad_steps == 0)


def refuse_backup(run: Run, step: int, reason: str, why: str) -> None:
    """A backup holding NaN or inf is never written (resuming it would only fail again): say
    so, keep the previous one, and list the refusal in run.json."""
    kept = (f"the backup of step {run.last_backup_step} is kept"
            if run.last_backup_step > 0 else "there is no earlier backup")
    run.callbacks.on_status(f"backup refused: {why}; {kept}")
    refused = [*run.record.data.get("backups_refused", []),
               {"step": step, "reason": reason, "why": why}]
    run.record.write(backups_refused=refused)
    run.refused_backup_step = step
    run.last_backup_time = time.monotonic()  # try again one interval later, not every step
