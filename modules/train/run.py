"""A started run: everything it owns, and the small steps the training loop reads as one
sentence each (modules/train/start.py builds it)."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Sampler

from modules.compile import COMPONENTS as COMPILE_COMPONENTS
from modules.compile import CompileEngine
from modules.config.optimizers import OPTIMIZERS
from modules.config.prompts import SamplePrompt
from modules.config.schema import Config
from modules.data.dataset import ImageCaptionDataset, epoch_dataloader, set_sampler_epoch
from modules.events import TrainerCallbacks, TrainerCommands
from modules.models.families import ModelFamily
from modules.models.loader import ModelBundle
from modules.train.backup import (BackupError, BoundaryState, NonFiniteBackup, backups_folder,
                                  save_backup, set_random_states)
from modules.train.batch_shapes import BatchShapeLog
from modules.train.builders import StepBudget, autocast_context, optimizer_scalars
from modules.train.compile_guard import COMPILE_DENOISER
from modules.train.distributed import Distributed, parameter_checksum
from modules.train.output_lock import OutputLock
from modules.train.record import RunRecord
from modules.train.resume_offer import saved_step
from modules.train.sampling import sample_images
from modules.train.state import TrainingState
from modules.train.text_cache import TextEncoderCache
from modules.train.weights import save_weights
from modules.util.disk import guarded_write

if TYPE_CHECKING:  # imported where a run builds them, only when the option is on
    from diffusers.training_utils import EMAModel
    from torch.utils.tensorboard import SummaryWriter


@dataclass
class Run:
    """One training run's objects and state, owned in one place.

    What a backup saves and restores (train/backup.py) is exactly: the trained weights in
    `bundle`, `optimizer`, `lr_scheduler`, `scaler`, `ema` and `state`. Everything else is
    rebuilt from the config when a run starts.
    """
    config: Config
    bundle: ModelBundle
    device: torch.device
    output_dir: Path
    record: RunRecord
    callbacks: TrainerCallbacks
    dataset: ImageCaptionDataset
    batches: Sampler[list]  # the epoch batch sampler, built once (start.py); budget counts it
    params: dict[str, list[torch.nn.Parameter]]  # trained parameters, per component
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    budget: StepBudget
    guard: CompileEngine
    dist: Distributed
    state: TrainingState
    scaler: torch.amp.GradScaler | None = None
    writer: SummaryWriter | None = None
    ema: EMAModel | None = None
    text_cache: TextEncoderCache | None = None
    prompts: list[SamplePrompt] = field(default_factory=list)  # sample prompts, read at the start
    # What the training forward calls, per component: the bundle's modules, or (several
    # processes) their DistributedDataParallel wrappers. Saving and sampling use the bundle.
    forward: dict[str, torch.nn.Module] = field(default_factory=dict)
    shape_log: BatchShapeLog = field(default_factory=BatchShapeLog)
    trained: list[str] = field(default_factory=list)
    restore_precision: Callable[[], None] = lambda: None  # undoes `float32_precision`
    lock: OutputLock | None = None       # held by the main process until the run closes
    boundary: BoundaryState | None = None  # the small states after the last optimizer step
    last_backup_step: int = -1
    refused_backup_step: int = -1  # a step whose backup held NaN/inf: not tried twice
    last_backup_time: float = field(default_factory=time.monotonic)

    @property
    def step(self) -> int:
        """Optimizer steps taken so far."""
        return self.state.step

    # Several processes agree on Stop through a collective, so they look only every this many
    # optimizer steps (a collective per step would stall CUDA graphs and the GPU queue).
    STOP_CHECK_EVERY_STEPS = 10

    @property
    def family(self) -> ModelFamily:
        """What the model's family does differently (noise, target, conditioning, denoiser)."""
        return self.bundle.family

    @property
    def trains_text_encoder(self) -> bool:
        return any(name.startswith("text_encoder") for name in self.trained)

    def loader_for_epoch(self, epoch: int, skip_batches: int = 0):
        """The DataLoader of `epoch`, over the batch sampler the step budget was counted on."""
        set_sampler_epoch(self.batches, epoch)
        return epoch_dataloader(self.dataset, self.batches, seed=self.config.training.seed,
                                num_workers=self.config.data.workers,
                                pin_memory=self.device.type == "cuda",
                                skip_batches=skip_batches)

    def stop_requested(self, commands: TrainerCommands) -> bool:
        """Stop, as seen by every process (only every few steps when there are several)."""
        if not self.dist.enabled:
            return commands.stop_requested
        if self.step % self.STOP_CHECK_EVERY_STEPS:
            return False
        return self.dist.any(commands.stop_requested)

    def varying_shape(self, tensor: torch.Tensor, component: str) -> torch.Tensor:
        """With aspect-ratio buckets the batch's size, height and width change between batches:
        under compile.dynamic AUTO the compiled component's input is marked up front, so a
        whole denoiser or VAE does not first compile static and then recompile at the second
        bucket (modules/compile/dynamic_dims.py). `component` is the compile engine's name."""
        if not self.config.data.aspect_buckets:
            return tensor
        return self.guard.mark_varying_input(component, tensor)

    def denoiser_input(self, noisy: torch.Tensor) -> torch.Tensor:
        """The noisy latents in the denoiser's memory layout (a channels-last denoiser's first
        convolution then reads them without a conversion), marked for varying shapes."""
        if self.config.training.channels_last:
            noisy = noisy.contiguous(memory_format=torch.channels_last)
        return self.varying_shape(noisy, COMPILE_DENOISER)

    def recompiles(self) -> int:
        """Recompiles so far, summed over the compiled components."""
        return sum(report["recompiles"] for report in self.guard.report().values())

    def autocast(self):
        return autocast_context(self.config, self.device)

    def pixel_shape(self, batch: dict) -> tuple[int, int, int]:
        """(batch, height, width) in pixels, whether the batch holds pixels or cached latents."""
        if "pixel_values" in batch:
            b, _, h, w = batch["pixel_values"].shape
            return b, h, w
        factor = self.bundle.latent_downscale
        b, _, h, w = batch["latents"].shape
        return b, h * factor, w * factor

    def encode_latents(self, batch: dict, vae_eps: torch.Tensor | None) -> torch.Tensor:
        """Latents × scaling factor: from the cache, or the VAE posterior with pre-drawn noise."""
        vae = self.bundle.vae
        if "latents" in batch:
            return batch["latents"].to(self.device, self.compute_dtype, non_blocking=True)
        pixels = self.varying_shape(batch["pixel_values"].to(self.device, vae.dtype,
                                                             non_blocking=True), "vae")
        posterior = vae.encode(pixels).latent_dist
        latents = posterior.mean + posterior.std * vae_eps.to(self.device, posterior.mean.dtype)
        return (latents * vae.config.scaling_factor).to(self.compute_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.bundle.denoiser.dtype

    def encode_captions(self, batch: dict, captions: list[str]) -> dict:
        """The denoiser's conditioning for `captions` (the batch's, after caption dropout)."""
        if self.text_cache is not None:
            hidden, pooled = self.text_cache.encode(captions, batch.get("caption_varies"))
        else:
            hidden, pooled = self.family.encode_text(self.bundle, captions, self.device,
                                                     self.forward)
        # Text encoders may be kept at another dtype than the denoiser (a fine-tuned denoiser
        # trains at model.train_dtype while frozen encoders stay at model.weight_dtype).
        hidden = hidden.to(self.compute_dtype)
        pooled = None if pooled is None else pooled.to(self.compute_dtype)
        _, height, width = self.pixel_shape(batch)
        return self.family.conditioning(hidden, pooled, batch, height, width)

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: dict) -> torch.Tensor:
        """The denoiser's training forward (through DDP when several processes train)."""
        name = self.bundle.denoiser_name
        denoiser = self.forward.get(name, self.bundle.denoiser)
        return self.family.predict(denoiser, self.denoiser_input(noisy), timesteps, conditioning)

    def gradient_sync(self, closes_window: bool):
        """Average gradients over the processes only on the micro-batch that closes a window."""
        return self.dist.gradient_sync(self.forward, closes_window)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def gradient_norm(self) -> torch.Tensor:
        """Unscale (fp16) and clip the gradients; return their total norm, still on the device
        (it is read with the loss, in the step's one host sync)."""
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        params = self.all_params()
        max_norm = self.config.training.max_grad_norm
        if max_norm:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    def optimizer_step(self, finite: bool) -> None:
        """Step the optimizer and the LR schedule and clear the gradients. A step whose loss
        or gradients are not finite leaves the weights (and the EMA) as they were."""
        if self.scaler:
            self.scaler.step(self.optimizer)  # skips by itself when the gradients hold inf/NaN
            self.scaler.update()
        elif finite:
            self.optimizer.step()
        self.lr_scheduler.step()
        # CUDA graphs on a trained component need gradients that stay allocated (see
        # modules/compile/plan.py: cudagraph_rules); otherwise free them between steps.
        self.optimizer.zero_grad(set_to_none=not self.guard.persistent_grads)
        if self.ema is not None and finite:
            self.ema.step(self.all_params())

    def mark_boundary(self) -> None:
        """Remember the small states as they are now, between two optimizer steps."""
        self.boundary = BoundaryState.capture(self.state.state_dict())

    def trained_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The trained parameters by `component.parameter_name` (stable across processes)."""
        wanted = {id(p) for p in self.all_params()}
        named: dict[str, torch.nn.Parameter] = {}
        for component in self.params:
            for name, param in self.bundle.component(component).named_parameters():
                if id(param) in wanted:
                    named[f"{component}.{name}"] = param
        return named

    def state_dict(self, boundary: BoundaryState) -> dict:
        """Everything a backup holds (train/backup.py writes it): the trained weights, the
        optimizer, LR schedule, scaler and EMA, and the small states at `boundary`."""
        states = {"parameters": self.trained_parameters(),
                  "optimizer": self.optimizer.state_dict(),
                  "lr_scheduler": self.lr_scheduler.state_dict(),
                  "training": boundary.training, "random": boundary.random}
        if self.scaler is not None:
            states["scaler"] = self.scaler.state_dict()
        if self.ema is not None:
            states["ema"] = self.ema.state_dict()
        return states

    def load_state_dict(self, states: dict) -> None:
        """Put a backup's states into this freshly started run (same config in what changes
        the math)."""
        params = self.trained_parameters()
        saved = states["parameters"]
        if set(saved) != set(params):
            missing = sorted(set(params) - set(saved))[:3]
            extra = sorted(set(saved) - set(params))[:3]
            raise BackupError(f"the backup's trained parameters do not match this run's "
                              f"(missing {missing}, unexpected {extra})")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(saved[name].to(param.device, param.dtype))
        self.optimizer.load_state_dict(states["optimizer"])
        self.lr_scheduler.load_state_dict(states["lr_scheduler"])
        if self.scaler is not None and "scaler" in states:
            self.scaler.load_state_dict(states["scaler"])
        if self.ema is not None and "ema" in states:
            self.ema.load_state_dict(states["ema"])
        self.state.load_state_dict(states["training"])
        set_random_states(states["random"])

    def backup_due(self) -> bool:
        out = self.config.output
        by_steps = out.backup_every_steps and self.step % out.backup_every_steps == 0
        by_time = (out.backup_every_minutes
                   and time.monotonic() - self.last_backup_time >= 60 * out.backup_every_minutes)
        # not while steps are being skipped as non-finite: keep the backups from before that
        return (bool(by_steps or by_time) and self.step < self.budget.total_steps
                and self.state.bad_steps == 0)

    def backup(self, reason: str) -> Path | None:
        """Write a backup at the last step boundary (once per step; the main process only)."""
        if (not self.dist.is_main or self.boundary is None
                or self.boundary.training["step"] in (0, self.last_backup_step,
                                                      self.refused_backup_step)):
            return None
        step = self.boundary.training["step"]
        self.callbacks.on_status(f"writing a backup at step {step} ({reason})")
        try:
            folder = guarded_write(lambda: save_backup(self.state_dict(self.boundary),
                                                       self.config, self.output_dir, reason),
                                   backups_folder(self.output_dir), self.backup_bytes())
        except NonFiniteBackup as exc:
            self.refuse_backup(step, reason, str(exc))
            return None
        self.last_backup_step = self.boundary.training["step"]
        self.last_backup_time = time.monotonic()
        self.record.write(last_backup=str(folder), last_backup_step=self.last_backup_step)
        return folder

    def refuse_backup(self, step: int, reason: str, why: str) -> None:
        """A backup holding NaN or inf is never written (resuming it would only fail again):
        say so, keep the previous one, and list the refusal in run.json."""
        kept = (f"the backup of step {self.last_backup_step} is kept"
                if self.last_backup_step > 0 else "there is no earlier backup")
        self.callbacks.on_status(f"backup refused: {why}; {kept}")
        refused = [*self.record.data.get("backups_refused", []),
                   {"step": step, "reason": reason, "why": why}]
        self.record.write(backups_refused=refused)
        self.refused_backup_step = step
        self.last_backup_time = time.monotonic()  # try again one interval later, not every step

    def backup_bytes(self) -> int:
        """About what one backup takes: trained weights, optimizer state and EMA copies."""
        weights = sum(p.numel() * p.element_size() for p in self.all_params())
        per_weight = OPTIMIZERS[self.config.training.optimizer].state_per_weight
        state = int(sum(p.numel() * 4 * per_weight for p in self.all_params()))  # fp32 copies
        return weights * (2 if self.ema is not None else 1) + state

    def all_params(self) -> list[torch.nn.Parameter]:
        return [p for plist in self.params.values() for p in plist]

    @contextlib.contextmanager
    def averaged_weights(self):
        """Swap the averaged weights in (for sampling and saving) and the live ones back after:
        the EMA's, or schedule-free AdamW's (its `eval()` weights). The live weights come back
        bit for bit (a copy, not `train()`'s inverse interpolation), so sampling and saving
        never change what training does next and a resumed run stays exact."""
        if OPTIMIZERS[self.config.training.optimizer].schedule_free:
            live = [p.detach().clone() for p in self.all_params()]
            self.optimizer.eval()
            try:
                yield
            finally:
                self.optimizer.train()
                with torch.no_grad():
                    for param, saved in zip(self.all_params(), live):
                        param.copy_(saved)
            return
        if self.ema is None:
            yield
            return
        self.ema.store(self.all_params())
        self.ema.copy_to(self.all_params())
        try:
            yield
        finally:
            self.ema.restore(self.all_params())

    def current_lr(self) -> float:
        """The first parameter group's learning rate for the next step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def log_scalars(self, loss: float, smoothed: float) -> None:
        """TensorBoard's curves, and what the optimizer reports (Prodigy's d) in run.json."""
        scalars = optimizer_scalars(self.config, self.optimizer)
        if scalars:
            self.record.data["optimizer"] = {"name": self.config.training.optimizer.value,
                                             "step": self.step, **scalars}
        if self.writer:
            self.writer.add_scalar("loss/step", loss, self.step)
            self.writer.add_scalar("loss/smoothed", smoothed, self.step)
            self.writer.add_scalar("lr", self.current_lr(), self.step)
            for name, value in scalars.items():
                self.writer.add_scalar(f"optimizer/{name}", value, self.step)

    def distributed_summary(self) -> dict:
        """World size, and whether every rank ended with the same weights and ran compiled code."""
        checksums = self.dist.gather(parameter_checksum(self.all_params()))
        ran = [name for name, r in self.guard.report().items() if r.get("compiled_code_ran")]
        ran_everywhere = {name: all(self.dist.gather(1.0 if name in ran else 0.0))
                          for name in COMPILE_COMPONENTS}
        return {"world_size": self.dist.world_size, "backend": self.dist.backend,
                "data_parallel": {name: type(module).__name__
                                  for name, module in self.forward.items()},
                "ranks_in_sync": max(checksums) - min(checksums) <= 1e-6 * max(1.0, abs(checksums[0])),
                "weight_checksums": checksums, "compiled_code_ran_on_all_ranks": ran_everywhere}

    def sample(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Sample every prompt; `should_stop` (Stop) is asked between prompts and denoising
        steps, so a stop does not wait for the whole pass."""
        if not self.dist.is_main:
            return
        self.callbacks.on_status(f"sampling at step {self.step}")
        self.state.last_sample_step = self.step
        # Compiled code is bypassed: sampling (eval mode, no gradients, another batch size)
        # would otherwise recompile the training graphs for work that is not the hot path.
        with self.averaged_weights(), self.guard.bypassed():
            rows = sample_images(self.bundle, self.config, self.prompts, self.device, self.step,
                                 self.output_dir / "samples", should_stop)
        if len(rows) < len(self.prompts):
            self.callbacks.on_status(f"sampling at step {self.step} cut short by Stop "
                                     f"({len(rows)} of {len(self.prompts)} "
                                     "samples written)")
        for i, (path, prompt, image) in enumerate(rows):
            self.record.add_file(path)
            self.callbacks.on_sample(path, prompt, self.step)
            if self.writer:
                import numpy as np
                self.writer.add_image(f"sample/{i}", np.asarray(image), self.step,
                                      dataformats="HWC")

    def save_checkpoint(self, name: str) -> None:
        self._save(self.output_dir / "checkpoints" / name)

    def save_final(self) -> bool:
        """Save final/, unless this is a resumed segment and final/ already holds weights of a
        later step (a finished run continued from an older backup, then stopped): those are
        kept, and the status and run.json say so. Returns whether final/ was written."""
        folder = self.output_dir / "final"
        if self.dist.is_main and self.config.training.resume_from:
            kept = saved_step(folder)  # an unreadable marker raises: never replace blindly
            if kept is not None and kept > self.step:
                message = (f"final/ holds the weights of step {kept}, later than this segment's "
                           f"step {self.step}: final/ was kept, not replaced (this segment's "
                           "state is in its newest backup)")
                self.callbacks.on_status(message)
                self.record.write(final_kept={"final_step": kept, "segment_step": self.step,
                                              "reason": message})
                return False
        self._save(folder)
        return True

    def _save(self, folder: Path) -> None:
        if not self.dist.is_main:
            return
        self.callbacks.on_status(f"saving {folder.name} at step {self.step}")
        with self.averaged_weights():
            written = guarded_write(lambda: save_weights(self.bundle, self.config, folder,
                                                         self.step),
                                    folder, self.backup_bytes())
        for path in written:
            self.record.add_file(path)
        self.record.write(step=self.step)
        self.callbacks.on_saved(folder, self.step)

    def close(self) -> None:
        self.guard.close()
        self.restore_precision()
        if self.writer:
            self.writer.close()
        if self.lock is not None:
            self.lock.release()


def item_buckets(config: Config, dataset) -> list[tuple[int, int]] | None:
    """Each item's bucket for the batch sampler, or None when buckets are off."""
    return dataset.target_sizes if config.data.aspect_buckets else None
