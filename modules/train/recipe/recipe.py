"""One training run as a recipe read top to bottom (the shape of torchtune's single-device LoRA
recipe): `setup` builds everything the run needs from the prepared run, `train_step` is one
optimizer step, `train` is the loop, `save_backup` / `load_backup` write and read the run's
state, `close` lets go of what the run holds.

The run's state is typed data: `Run` (train/state/run.py) with one `state_dict` / `load_state_dict`
pair. The loop's helpers around the step (the window's micro-batches, what a step reports,
when a backup is due) are in train/recipe/loop.py. One optimizer step passes through four files:
this one (`train_step`, `micro_step` and the small helpers below it), the model family (models/families/: conditioning, noise and
target, the denoiser's call), the objective and step helpers (train/recipe/objectives.py,
train/recipe/builders.py) and the guarded compile window (compile/guarded.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from modules.compile.engine import CompileEngine
from modules.config.schema import Config, MixedPrecision, TrainingMethod
from modules.data.buckets import describe_buckets, resolution_plan
from modules.data.dataset import (BucketBatchSampler, EpochBatches, ImageCaptionDataset,
                                  epoch_batch_sampler, expand_repeats)
from modules.data.latent_cache import CachedLatentDataset
from modules.events import StopRequested, TrainerCallbacks, TrainerCommands
from modules.train.recipe.adapters import seed_adapter_dropout
from modules.train.state.backup import (NonFiniteBackup, ResumePoint, backups_folder, load_states,
                                        save_backup)
from modules.train.recipe.builders import (Draws, autocast_context, build_lr_scheduler,
                                           build_optimizer, draw_randomness, float32_precision,
                                           StepBudget, latent_shape, step_budget)
from modules.train.outputs.checkpoints import due_checkpoint
from modules.models.model_hash import base_model_hashes
from modules.models.families import family_of
from modules.paths import cache_dir_for
from modules.train.memory.offload import (BlockStreamer, build_streamer, held_on_host,
                                          offload_choice)
from modules.train.memory.offload_trained import HostSteps
from modules.train.outputs.data_metadata import training_data_metadata
from modules.train.recipe.compile_scope import resolve_compile_scope
from modules.train.recipe.compile_guard import (build_compile_guard, component_blocks,
                                                denoiser_compile_cost)
from modules.train.recipe.compile_ahead import (CompileAhead, finish_compile_ahead,
                                                start_compile_ahead, stop_compile_ahead)
from modules.train.recipe.distributed import Distributed, clip_sharded_gradients, launcher_record
from modules.train.recipe.placement import borrowed, components_off_device, placement_record
from modules.train.recipe.fused import FusedBackward, fused_record
from modules.train.recipe.objectives import (caption_dropouts, diffusion_loss, drop_captions,
                                             elementwise_loss, multires_noise,
                                             noise_offset_strength, noisy_input_and_target,
                                             offset_noise, sample_weights, step_timesteps,
                                             timestep_terms)
from modules.train.outputs.metrics import RunMetrics
from modules.train.outputs.main_writes import agreed_write
from modules.train.outputs.writes import (agreed_requests, backup_bytes, distributed_summary,
                                          log_scalars, sample, sample_due, save_checkpoint,
                                          save_final, start_wandb_logging)
from modules.train.setup.prepare import PreparedRun
from modules.train.outputs.record import RunRecord, peak_memory
from modules.train.state.run import Run, item_buckets
from modules.train.recipe.text_cache import TextEncoderCache
from modules.train.state.sharded_state import sharded_backup_record
from modules.train.setup.start import (apply_changed_learning_rates, bucket_record, build_dataset,
                                       build_ema, prepare_output_folder, record_warnings,
                                       resume_hint, start_record, take_output_lock,
                                       tensorboard_writer, text_encoder_cache)
from modules.train.state.training_state import TrainingState, draws_generator
from modules.train.validation.validation import (last_validated_step, validation_due,
                                                 validation_pass, validation_record)
from modules.train.validation.validation_set import build_validator
from modules.train.recipe.trainable import (apply_denoiser_memory_format,
                                            enable_gradient_checkpointing, prepare_trainable,
                                            trained_components, weight_storage_record)
from modules.train.outputs.saving import hashes_base_model
from modules.train.recipe.step_inputs import denoiser_input, encode_captions, encode_latents
from modules.train.recipe.textual_inversion import (is_textual_inversion, keep_old_rows,
                                                    prompt_with_trigger,
                                                    textual_inversion_record, with_trigger)
from modules.util.disk import DiskFull, guarded_write
from modules.train.recipe.loop import (MicroBatch, backup_due, batches, feeding, mark_boundary,
                                       mark_end, progress_event, refuse_backup,
                                       skip_non_finite_step)


class StepResult(NamedTuple):
    """What one optimizer step reports (`train_step`), read in the step's one host sync."""
    loss: float        # the window's mean loss over every process
    finite: bool       # loss and gradients finite: the optimizer stepped
    grad_norm: float   # the gradients' total norm before clipping (`training.max_grad_norm`)
    images: int        # images the step trained, over every process


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
        self.record: RunRecord | None = None  # run.json, once `setup` started it

    # ------------------------------------------------------------------------------ setup
    def setup(self) -> Run:
        """Create the output folder and everything the loop needs; the first write happens
        here. A Stop during latent caching raises StopRequested, with run.json saying
        `stopped`.

        Whatever setup changes beyond the run's own objects (the output folder's lock, the
        offload streamer and the fused backward's hooks on the weights, the float32 precision
        switches, the compile engine's process-wide settings, TensorBoard's and W&B's files) is
        undone by a function pushed onto one exit stack as it is done: a failure on the way
        unwinds exactly what was done so far (the GUI trains the next run in this process),
        and a built run owns the stack (`Run.close` unwinds it)."""
        with contextlib.ExitStack() as undo:
            if self.dist.is_main:
                lock = take_output_lock(Path(self.prepared.config.output.dir), self.callbacks)
                undo.callback(lock.release)
            run = self._build(undo)
            run.undo = undo.pop_all()
        self.run = run
        return run

    @property
    def built_run(self) -> Run:
        """The run `setup` built: what train, train_step and save_backup work on."""
        if self.run is None:
            raise RuntimeError("the training recipe has no run before setup()")
        return self.run

    def _build(self, undo: contextlib.ExitStack) -> Run:
        """`setup`'s body as named steps, in the order the run depends on: the record first,
        the trained weights chosen, the captions and latents cached (each encoder alone on the
        device) before the rest of the weights move there (compile.ahead: its process started
        before the caching and waited for before compile), the optimizer, compile before the
        DDP wrap, the state last. Each change made outside the run's objects pushes its undo
        onto `undo` right after it is made. A new lever gets a step of its own here."""
        device = self.dist.device or self.prepared.device
        record, config, ahead = self._setup_record_and_scope(undo, device)
        bundle = self.prepared.bundle
        trained, params = self._setup_trainable(config, record)
        text_cache, off, dataset = self._setup_data(config, device, record)
        offload, params = self._setup_placement(undo, config, device, off, trained, params,
                                                record)
        batches, budget = self._setup_batches(config, dataset, record)
        optimizer, scaler = self._setup_optimizer(undo, config, device, params, offload, record)
        guard = self._setup_compile(undo, config, device, params, trained, optimizer, ahead,
                                    record)
        components = bundle.components()
        forward = self.dist.wrap_trained({name: components[name] for name in trained})
        writer = RunMetrics(tensorboard_writer(config, self.dist.is_main))
        undo.callback(writer.close)  # TensorBoard's file, and the W&B run once it is added
        prepared = self.prepared
        run = Run(config, bundle, device, Path(config.output.dir), record, self.callbacks,
                  dataset, batches, params, optimizer,
                  build_lr_scheduler(config, optimizer, budget.total_steps), budget, guard,
                  self.dist,
                  TrainingState(generator=draws_generator(config.training.seed,
                                                          self.dist.rank)),
                  scaler=scaler, writer=writer,
                  trained=trained, ema=build_ema(config, params),
                  text_cache=text_cache,
                  forward=forward,
                  # check_run read them (the prompts file once); TEXTUAL_INVERSION's show
                  # the trigger word
                  prompts=[dataclasses.replace(p, text=prompt_with_trigger(config, p.text))
                           for p in prepared.prompts],
                  validator=build_validator(config, prepared.validation))
        run.offload = offload
        self._setup_state(run)
        return run

    def _setup_record_and_scope(self, undo: contextlib.ExitStack, device: torch.device
                                ) -> tuple[RunRecord, Config, CompileAhead | None]:
        """Setup step: the output folder and run.json; compile.scope=AUTO decided (its
        measurement runs in processes of its own, before the weights move to the device:
        every later step sees the chosen scope); compile ahead started, so that its process
        compiles the batch shapes while the captions and latents are cached (a Stop or a
        failure in setup ends it: the undo)."""
        prepared, callbacks, dist = self.prepared, self.callbacks, self.dist
        record = self.record = prepare_output_folder(prepared, callbacks, dist.is_main)
        start_record(record, prepared, device)
        config, scope_choice = resolve_compile_scope(
            prepared.config, device, multi_process=dist.enabled, notify=callbacks.on_status,
            should_stop=lambda: self.commands.stop_requested)
        if scope_choice is not None:
            self.prepared = dataclasses.replace(prepared, config=config)
            record.write(compile_scope=scope_choice.record())
            callbacks.on_status(scope_choice.describe())
            for problem in scope_choice.problems:
                callbacks.on_status(f"warning: {problem}")
        if dist.enabled:  # what starts it again with its processes (the CLI's resume command)
            record.write(launcher=launcher_record())
        ahead = start_compile_ahead(config, device, dist.enabled, callbacks, record)
        if ahead is not None:
            undo.callback(stop_compile_ahead, ahead, record)
        return record, config, ahead

    def _setup_trainable(self, config: Config, record: RunRecord
                         ) -> tuple[list[str], dict[str, list[torch.nn.Parameter]]]:
        """Setup step: the trained weights (adapters added, frozen weights stored as
        `model.weight_storage` says; LoRA init draws from the global generator, seeded here)
        and gradient checkpointing. Returns the trained components and their parameters."""
        bundle = self.prepared.bundle
        torch.manual_seed(config.training.seed)
        trained = trained_components(config)
        params = prepare_trainable(bundle, config)
        record.write(weight_storage=weight_storage_record(bundle, config))
        if is_textual_inversion(config):
            record.write(textual_inversion=textual_inversion_record(bundle, config))
        if config.training.gradient_checkpointing:
            enable_gradient_checkpointing(bundle, trained)
        return trained, params

    def _setup_data(self, config: Config, device: torch.device, record: RunRecord
                    ) -> tuple[TextEncoderCache | None, dict[str, tuple[str, str]],
                               ImageCaptionDataset | CachedLatentDataset]:
        """Setup step, before the denoiser moves: a text encoder that can leave the device
        encodes every caption alone on it, then stays on the CPU; the dataset is built with
        its latents cached by the VAE alone on the device (a VAE that leaves the device,
        placement.py, goes back to the CPU when they are). A Stop during the caching raises
        StopRequested with run.json saying so (no step was trained: a resumed run's backups
        stay as they were). Returns the text cache, the components kept off the device and
        the dataset."""
        prepared, bundle = self.prepared, self.prepared.bundle
        text_cache = text_encoder_cache(prepared, bundle, device, self.callbacks)
        off = components_off_device(config)  # the text encoders have left already
        record.write(placement=placement_record(config, device))
        try:
            with borrowed({"vae": bundle.vae} if config.data.cache_latents else {}, device):
                dataset = build_dataset(prepared, self.callbacks,
                                        lambda: self.commands.stop_requested)
        except StopRequested:
            record.write(status="stopped", stopped_during="latent caching")
            raise
        return text_cache, off, dataset

    def _setup_placement(self, undo: contextlib.ExitStack, config: Config,
                         device: torch.device, off: dict[str, tuple[str, str]], trained: list[str],
                         params: dict[str, list[torch.nn.Parameter]], record: RunRecord
                         ) -> tuple[BlockStreamer | None,
                                    dict[str, list[torch.nn.Parameter]]]:
        """Setup step: the weights to the device (the blocks block offload streams stay on
        the host: never whole on the device, the load's peak), the denoiser's memory format,
        the offload streamer (before compile: its calls sit around the blocks' compiled
        code), and FSDP's sharding of each trained component block by block (before compile,
        and before the optimizer: DTensors replace the parameters). Returns the streamer and
        the trained parameters (the sharded ones under FSDP)."""
        bundle = self.prepared.bundle
        offloaded = offload_choice(bundle.denoiser, family_of(bundle.model_type).repeated_blocks,
                                   config.model.offload_blocks,
                                   trained=config.training.method == TrainingMethod.FINE_TUNE)
        with held_on_host(offloaded):
            for name, module in bundle.components().items():
                if name not in off:
                    # transformers' PreTrainedModel.to is @wraps(nn.Module.to): typeshed's
                    # _Wrapped keeps the unbound signature, so mypy reads `device` as `self`
                    module.to(device)  # type: ignore[arg-type]  # see above
        apply_denoiser_memory_format(bundle, config)
        offload = build_streamer(offloaded, device)
        if offload is not None:
            undo.callback(offload.close)
        record.write(block_offload=offload.record() if offload else {"blocks": 0})
        sharded = self.dist.shard_trained({name: bundle.component(name) for name in trained},
                                          component_blocks(bundle))
        if sharded:
            params = {name: [p for p in bundle.component(name).parameters() if p.requires_grad]
                      for name in params}
        return offload, params

    def _setup_batches(self, config: Config,
                       dataset: ImageCaptionDataset | CachedLatentDataset, record: RunRecord
                       ) -> tuple[EpochBatches, StepBudget]:
        """Setup step: the one batch sampler training uses (this process's share; aspect
        buckets or several resolutions recorded, with the compile estimate for their shapes)
        and the step budget counted on it."""
        prepared, dist = self.prepared, self.dist
        buckets = item_buckets(config, dataset)  # None: one resolution, no aspect buckets
        batches = epoch_batch_sampler(len(dataset), config.training.batch_size,
                                      config.training.seed, rank=dist.rank,
                                      world_size=dist.world_size, buckets=buckets)
        budget = step_budget(config, len(batches))
        record_warnings(record, config, budget.total_steps, self.callbacks)
        if buckets is not None and isinstance(batches, BucketBatchSampler):
            plan = resolution_plan(config.data, expand_repeats(prepared.scan))
            several = len(plan.distinct) > 1
            record.write(buckets=bucket_record(buckets, batches, plan if several else None))
            cost = denoiser_compile_cost(config, plan.shape_sets(config.training.batch_size,
                                                                 dist.world_size))
            record.write(compile_estimate=cost.record() if cost is not None else None)
            self.callbacks.on_status(
                f"{'buckets' if several else 'aspect buckets'}: "
                f"{plan.describe() if several else describe_buckets(buckets)}; "
                f"{len(batches)} batches per epoch, {batches.short_batches()} short")
        return batches, budget

    def _setup_optimizer(self, undo: contextlib.ExitStack, config: Config,
                         device: torch.device, params: dict[str, list[torch.nn.Parameter]],
                         offload: BlockStreamer | None, record: RunRecord
                         ) -> tuple[torch.optim.Optimizer, torch.amp.GradScaler | None]:
        """Setup step: the optimizer (the fused backward's hooks undone with the run;
        offloaded trained weights stepped on the host), textual inversion's kept rows, and
        fp16's gradient scaler."""
        optimizer = build_optimizer(config, params)
        if isinstance(optimizer, FusedBackward):
            undo.callback(optimizer.close)  # its hooks off the weights
            if offload is not None and offload.trained:  # offloaded weights step on the host
                optimizer.host_steps = HostSteps(offload)
                record.write(block_offload={**offload.record(),
                                            **optimizer.host_steps.record()})
        elif offload is not None and offload.trained:  # validation refuses it: never silently
            raise RuntimeError("block offload of a full fine-tune needs the fused backward "
                               "pass (its device copies are dropped, never stepped)")
        keep_old_rows(optimizer, self.prepared.bundle, config)  # TEXTUAL_INVERSION: new rows
        scaler = (torch.amp.GradScaler(device.type)
                  if config.training.mixed_precision == MixedPrecision.FP16 else None)
        return optimizer, scaler

    def _setup_compile(self, undo: contextlib.ExitStack, config: Config, device: torch.device,
                       params: dict[str, list[torch.nn.Parameter]], trained: list[str],
                       optimizer: torch.optim.Optimizer, ahead: CompileAhead | None,
                       record: RunRecord) -> CompileEngine:
        """Setup step: float32 matmul precision, the bundle compile ahead wrote (waited for
        here; a Stop raises StopRequested with run.json saying so), and the compile guard
        over the components (undone with the run); persistent gradients where CUDA graphs
        need them."""
        restore_precision, precision = float32_precision(config, device)
        undo.callback(restore_precision)
        try:  # the bundle compiled ahead, which the compile engine then loads
            ahead_bundle = finish_compile_ahead(ahead, self.callbacks, record,
                                                lambda: self.commands.stop_requested)
        except StopRequested:
            record.write(status="stopped", stopped_during="compile ahead")
            raise
        guard = build_compile_guard(config, self.prepared.bundle, device, params, trained,
                                    self.callbacks, writes_bundle=self.dist.is_main,
                                    ahead_bundle=ahead_bundle)
        undo.callback(guard.close)  # the compiled modules eager again, dynamo's settings back
        record.write(compile_bundle=guard.bundle_record())
        if isinstance(optimizer, FusedBackward):  # weights stepped in backward: no replay
            guard.guard.replay_blocker = optimizer.unfinished_step
        if guard.persistent_grads:
            for plist in params.values():
                for p in plist:
                    p.grad = torch.zeros_like(p)
        fused = fused_record(config, self.dist.world_size, guard.persistent_grads)
        if fused is not None:
            record.write(fused_backward=fused)
        record.write(precision=precision,
                     sampling="eager: compiled code is bypassed while sampling")
        return guard

    def _setup_state(self, run: Run) -> None:
        """Setup step, last: what the saved files say of the data and the base model, the
        resumed state (a backup), W&B (after the backup: it holds the W&B run id) and the
        validation history."""
        config, prepared = run.config, self.prepared
        run.file_metadata = training_data_metadata(prepared.scan, config)
        if self.dist.is_main and hashes_base_model(config):
            # hashing a base checkpoint reads all of it: only where a saved file carries it
            run.file_metadata.update(base_model_hashes(config.model.path,
                                                       cache_dir_for(config.general.cache_dir)))
        if prepared.resume is not None:
            self.load_backup(run, prepared.resume)
        if config.logging.wandb and self.dist.is_main:
            start_wandb_logging(run)
        if run.validator is not None:  # a resumed run's history is the backup's
            run.record.write(validation=validation_record(run))
        mark_boundary(run)

    # -------------------------------------------------------------------------- one step
    def train_step(self, micro_batches: Iterator[MicroBatch]) -> StepResult | None:
        """One optimizer step: the accumulation window's micro-steps, each run inside the
        compile window (a compile failure replays the whole window with the next backend),
        then the step's one host sync and the optimizer step. Returns what the step
        reports, or None when no micro-batch is left."""
        run = self.built_run
        config, state = run.config, run.state
        window = None
        images = 0
        for index, batch, closes_window in micro_batches:
            pixel_shape = run.pixel_shape(batch)
            images += pixel_shape[0]
            if window is None:  # the first micro-batch of the step: its draws are seeded
                state.reseed_draws(config.training.seed, run.dist.rank)
                seed_adapter_dropout(config, state.step, run.dist.rank)
            draws = draw_randomness(state.generator, latent_shape(run.bundle.vae, *pixel_shape),
                                    (config.loss.min_timestep, config.loss.max_timestep),
                                    need_vae_eps="latents" not in batch, loss=config.loss,
                                    continuous=run.family.objective.continuous_timesteps
                                    is not None)
            if window is None:
                window = run.guard.window()
            with run.dist.gradient_sync(run.forward, closes_window):
                window.run(functools.partial(micro_step, run, batch, draws), shape=pixel_shape)
            run.shape_log.add(pixel_shape, run.recompiles)
            if closes_window:
                break
        else:
            return None
        loss, norm, finite = read_step(run, window.results, gradient_norm(run))  # one sync
        optimizer_step(run, finite)
        state.step += 1
        state.batches_done = index + 1
        return StepResult(loss, finite, norm, images * run.dist.world_size)

    # -------------------------------------------------------------------------- the loop
    def train(self) -> RunResult:
        """The loop: step, log, sample, save, back up, until the budget is used or Stop."""
        run, callbacks, commands = self.built_run, self.callbacks, self.commands
        config, state = run.config, run.state
        step_started = time.perf_counter()
        sample_seconds: float | None = None  # the last sampling pass, for the ETA
        callbacks.on_status(f"training {run.budget.total_steps} steps on {run.device.type}"
                            + (f", from step {run.step}" if run.step else ""))

        if state.owed_passes:  # a stop skipped or cut short the passes of the step it ended
            callbacks.on_status(f"running step {run.step}'s {' and '.join(state.owed_passes)}, "
                                "which the stop cut short, before training on")
            step_passes(run, commands, "sample" in state.owed_passes and bool(run.prompts),
                        "validation" in state.owed_passes and run.validator is not None)
            mark_boundary(run)
        micro_batches = batches(run, commands)
        while (outcome := self.train_step(micro_batches)) is not None:
            loss, finite = outcome.loss, outcome.finite
            # Read after the step's one host sync (read_step): the time from the end of the
            # previous step's reporting to this step's sync, with no device sync of its own
            # (the optimizer step's kernels, queued after the sync, count in the next step).
            seconds = time.perf_counter() - step_started
            run.record.step_seconds.append(seconds)
            if run.guard.after_step():  # graphs compiled since the last bundle: write one
                run.record.write(compile_bundle=run.guard.bundle_record())
            if finite:
                state.bad_steps = 0
                run.record.losses.append(loss)
                smooth = state.smoothed.update(loss)
                callbacks.on_progress(progress_event(run, loss, smooth, sample_seconds))
                log_scalars(run, loss, smooth, outcome.grad_norm, seconds, outcome.images)
            else:
                skip_non_finite_step(run, loss)

            asked_sample, asked_save = agreed_requests(run, commands)  # the same on every rank
            sampled = step_passes(run, commands, sample_due(run, asked_sample),
                                  validation_due(run))
            sample_seconds = sampled if sampled is not None else sample_seconds
            if name := due_checkpoint(run.step, run.budget.total_steps, state.epoch,
                                      state.batches_done, run.budget.batches_per_epoch,
                                      config.output.save_every_steps,
                                      config.output.save_every_epochs, asked_save):
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
        if (run.validator is not None and status == "finished" and run.step > 0
                and last_validated_step(run) != run.step):
            validation_pass(run, forward_loss, lambda: commands.stop_requested)
        if status == "finished":
            self.save_final_backup()
        feeding(run)
        run.record.write(status=status, compile=run.guard.report(),
                         compile_bundle=run.guard.bundle_record(),
                         skipped_steps=state.skipped_steps,
                         batch_shapes=run.shape_log.report(run.recompiles()),
                         distributed=distributed_summary(run),
                         memory=peak_memory(run.device.type == "cuda"),
                         text_cache=None if run.text_cache is None else run.text_cache.record())
        hint = resume_hint(run.output_dir) if status == "stopped" else ""
        callbacks.on_status(f"{status}: {run.step} steps, outputs in {run.output_dir}{hint}")
        return RunResult(status, run.step, run.output_dir, dict(run.record.data))

    # --------------------------------------------------------------------------- backups
    def save_backup(self, reason: str, agreed: bool = True) -> Path | None:
        """Write a backup at the last step boundary (once per step; the main process writes).
        Every process calls it at the same points (the loop's decisions are the same on every
        rank: `backup_due`): under FSDP each takes part in gathering the sharded state, and
        under several processes the outcome of rank 0's write is agreed by all
        (`agreed_write`: a failed backup stops every rank). `agreed=False` (the backup after
        a failure, which the other ranks may not reach): rank 0 writes alone, nothing is
        agreed (not under FSDP, whose gathering needs every rank: none is tried then)."""
        run, boundary = self.built_run, self.built_run.boundary
        if (boundary is None or (not agreed and not run.dist.is_main)
                or boundary.training["step"] in (0, run.last_backup_step,
                                                 run.refused_backup_step)):
            return None
        step = boundary.training["step"]
        # FSDP: a collective, every process gathers; DDP: the main process's own weights
        states = run.state_dict(boundary) if run.dist.is_main or run.dist.sharded else {}
        if agreed:
            folder = agreed_write(run.dist, f"the backup of step {step} in "
                                            f"{backups_folder(run.output_dir)}",
                                  lambda: self._write_backup(states, step, reason))
        else:
            folder = self._write_backup(states, step, reason)
        if not run.dist.is_main:  # the others skip this step from now on too, as rank 0 does
            run.last_backup_step = step
            run.last_backup_time = time.monotonic()
        return folder

    def _write_backup(self, states: dict, step: int, reason: str) -> Path | None:
        """Rank 0's part of `save_backup`: the folder, or None when refused (NaN or inf)."""
        run = self.built_run
        # run.json's losses reach this step before the backup exists: a kill -9 between the
        # backup's rename and the record's write below left them a step or more short, and the
        # resumed run's curve shifted against its steps (RunRecord.continue_from keeps the
        # losses up to the backup's step, never more)
        run.record.write()
        run.callbacks.on_status(f"writing a backup at step {step} ({reason})")
        try:
            folder = guarded_write(lambda: save_backup(states, run.config, run.output_dir,
                                                       reason),
                                   backups_folder(run.output_dir), backup_bytes(run))
        except NonFiniteBackup as exc:
            refuse_backup(run, step, reason, str(exc))
            return None
        run.last_backup_step = step
        run.last_backup_time = time.monotonic()
        run.record.write(last_backup=str(folder), last_backup_step=run.last_backup_step)
        if run.dist.sharded:
            run.record.write(backups=sharded_backup_record(run.dist.world_size))
        return folder

    def save_final_backup(self) -> None:
        """A finished run's backup at its last step, so raising training.max_steps continues
        it from its end (docs/resume.md). Written after final/ and the end-of-run sample and
        validation, whose marks it holds (the step's random states stay the boundary's). A
        disk too full for it leaves the run finished, said and recorded: a continue would
        then start from the newest scheduled backup."""
        run = self.run
        if run is None or run.step == 0 or run.boundary is None:
            return
        mark_end(run)
        try:
            self.save_backup("finished")
        except DiskFull as exc:
            run.callbacks.on_status(f"no backup at the final step: {exc}")
            run.record.write(final_backup=f"not written: {exc}")

    def load_backup(self, run: Run, resume: ResumePoint) -> None:
        """Load the backup into the freshly built run (weights, optimizer, schedule, states)."""
        run.callbacks.on_status(f"resuming from {resume.folder} (step {resume.step})")
        if resume.changed:  # what may change on a resume and did (run.json: resume_changed)
            run.callbacks.on_status("changed since the backup: " + "; ".join(resume.changed))
        _, states = load_states(resume.folder)
        run.load_state_dict(states)
        apply_changed_learning_rates(run)
        run.last_backup_step = run.step

    def close(self) -> None:
        """Let go of what the run holds: what `setup` pushed onto the run's exit stack (the
        compile engine, the float32 precision settings, TensorBoard and W&B, the lock)."""
        if self.run is not None:
            self.run.close()


# ------------------------------------------------------------------ the step, beside the recipe
def step_passes(run: Run, commands: TrainerCommands, sample_due: bool,
                validate_due: bool) -> float | None:
    """The step's sampling and validation passes, where due. Stop is asked inside each (a
    stop does not wait for a long pass); a pass that Stop skipped or cut short is owed
    (`state.owed_passes`, in the backup the stop writes) and a resumed run runs it first,
    on the same weights. Returns the seconds of a complete sampling pass (for the ETA)."""
    def should_stop() -> bool:
        return commands.stop_requested

    owed, seconds = [], None
    if sample_due:
        started = time.perf_counter()
        if sample(run, should_stop):
            seconds = time.perf_counter() - started
        else:
            owed.append("sample")
    if validate_due:
        validation_pass(run, forward_loss, should_stop)
        if last_validated_step(run) != run.step:  # cut short: not a score
            owed.append("validation")
    if owed:
        run.callbacks.on_status(f"step {run.step}'s {' and '.join(owed)} will run when the "
                                "run is resumed (Stop cut it short)")
    run.state.owed_passes = owed
    return seconds


def note_held_back(run: Run, held_back: int) -> None:
    """Under the fused backward pass, say (and count in run.json) the weights whose gradients
    were not finite: they kept their values and optimizer state, the others stepped."""
    total = len(run.optimizer.weights)  # type: ignore[attr-defined]
    run.callbacks.on_status(f"step {run.step}: {held_back} of {total} weights had non-finite "
                            "gradients and kept their values (fused backward: the other "
                            "weights were updated)")
    fused = dict(run.record.data.get("fused_backward", {}))
    fused["weights_held_back"] = fused.get("weights_held_back", 0) + held_back
    run.record.write(fused_backward=fused)


def micro_step(run: Run, batch: dict, draws: Draws) -> torch.Tensor:
    """One forward + backward on a batch: `forward_loss`, then backward.

    Returns the loss as a tensor on the device: reading it (a host sync) waits for the
    optimizer step, so CUDA graphs and asynchronous kernels are not stalled every micro-step.
    """
    if run.offload is not None:
        run.offload.begin()
    try:
        loss = forward_loss(run, batch, draws)
        if isinstance(run.optimizer, FusedBackward) and not torch.isfinite(loss):
            return loss.detach()  # backward would step the weights with non-finite gradients
        scaled = loss / run.config.training.gradient_accumulation
        (run.scaler.scale(scaled) if run.scaler else scaled).backward()
        return loss.detach()
    finally:
        if run.offload is not None:
            run.offload.end()  # nothing offloaded stays on the device between micro-steps


def forward_loss(run: Run, batch: dict, draws: Draws) -> torch.Tensor:
    """The training loss of a batch with its draws: encode, noise, predict, loss. Training
    (`micro_step`) and validation (train/validation/validation.py, under no_grad) both call it, so the
    validation score is the loss training minimises.

    What differs between model families (the noise and the target, the conditioning, how the
    denoiser is called) is asked of `run.family`.
    """
    family, device, t, options = run.family, run.device, run.config.training, run.config.loss
    with autocast_context(run.config, device):
        with torch.no_grad():
            latents = encode_latents(run, batch, draws.vae_eps)
        noise = offset_noise(draws.noise.to(device, latents.dtype), draws.noise_offset,
                             noise_offset_strength(latents, t.noise_offset,
                                                   options.adaptive_noise_scale))
        noise = multires_noise(noise, draws.multires, options.multires_noise_discount)
        timesteps = step_timesteps(family.objective, run.bundle, draws, options,
                                   latents.shape[-2:]).to(device)
        noisy, target = noisy_input_and_target(family.objective, run.bundle, latents, noise,
                                               timesteps, draws.perturbation,
                                               options.input_perturbation)
        captions = drop_captions([with_trigger(run.config, c) for c in batch["caption"]],
                                 draws.caption_dropout,
                                 caption_dropouts(run.config, batch["source"]))
        # under validation's no_grad a trained text encoder builds no graph either
        with torch.set_grad_enabled(run.trains_text_encoder and torch.is_grad_enabled()):
            conditioning = encode_captions(run, batch, captions)
        denoiser = run.forward.get(run.bundle.denoiser_name, run.bundle.denoiser)  # DDP or not
        prediction = family.predict(denoiser, denoiser_input(run, noisy), timesteps,
                                    conditioning)
        weights, huber_c = timestep_terms(family.objective, run.bundle, timesteps, run.config)
        weights = sample_weights(weights, batch.get("loss_weight"))  # prior_loss_weight
        return diffusion_loss(elementwise_loss(prediction, target, options.loss_type, huber_c),
                              weights, batch.get("mask"))


def gradient_norm(run: Run) -> torch.Tensor:
    """Unscale (fp16) and clip the gradients; return their total norm, still on the device
    (it is read with the loss, in the step's one host sync). The fused backward pass stepped
    and clipped each weight already: its norm is the one it measured on the way."""
    if isinstance(run.optimizer, FusedBackward):
        return run.optimizer.gradient_norm()
    if run.scaler:
        run.scaler.unscale_(run.optimizer)
    params = run.all_params()
    max_norm = run.config.training.max_grad_norm
    if run.dist.sharded:
        return clip_sharded_gradients(params, max_norm)
    if max_norm:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])


def read_step(run: Run, losses: list[torch.Tensor], grad_norm: torch.Tensor
              ) -> tuple[float, float, bool]:
    """The window's mean loss (over every process), the gradients' norm before clipping and
    whether loss and gradients are finite, read from the device together: the step's one
    host sync."""
    loss_mean = torch.stack(losses).float().mean()
    loss, norm = torch.stack([loss_mean, grad_norm.float().to(loss_mean.device)]).tolist()
    loss = run.dist.mean(loss)
    finite = math.isfinite(loss) and (run.scaler is not None or math.isfinite(norm))
    return loss, norm, finite


def optimizer_step(run: Run, finite: bool) -> None:
    """Step the optimizer and the LR schedule and clear the gradients. A step whose loss or
    gradients are not finite leaves the weights (and the EMA) as they were; under the fused
    backward pass only the weights whose own gradients were not finite kept theirs."""
    if isinstance(run.optimizer, FusedBackward):  # the hooks stepped the weights in backward
        if run.optimizer.held_back:
            note_held_back(run, run.optimizer.held_back)
        run.optimizer.step()  # closes the step, finite or not (no scaler: refused)
    elif run.scaler:
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
