"""A started run's objects and state, as typed data (`TrainingRecipe.setup` in
modules/train/recipe.py builds it; the recipe's step and loop read it), with the run's one
`state_dict` / `load_state_dict` pair and the saving and sampling the loop asks for."""
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
from modules.train.backup import BackupError, BoundaryState, set_random_states
from modules.train.batch_shapes import BatchShapeLog
from modules.train.builders import StepBudget, optimizer_scalars
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
    """One training run's objects and state, owned in one place (the recipe's data).

    What a backup saves and restores (`state_dict` / `load_state_dict`, written by
    train/backup.py) is exactly: the trained weights in `bundle`, `optimizer`, `lr_scheduler`,
    `scaler`, `ema` and `state`. Everything else is rebuilt from the config when a run starts.
    """
    config: Config
    bundle: ModelBundle
    device: torch.device
    output_dir: Path
    record: RunRecord
    callbacks: TrainerCallbacks
    dataset: ImageCaptionDataset
    batches: Sampler[list]  # the epoch batch sampler, built once (recipe.setup); budget counts it
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

    def recompiles(self) -> int:
        """Recompiles so far, summed over the compiled components."""
        return sum(report["recompiles"] for report in self.guard.report().values())

    def pixel_shape(self, batch: dict) -> tuple[int, int, int]:
        """(batch, height, width) in pixels, whether the batch holds pixels or cached latents."""
        if "pixel_values" in batch:
            b, _, h, w = batch["pixel_values"].shape
            return b, h, w
        factor = self.bundle.latent_downscale
        b, _, h, w = batch["latents"].shape
        return b, h * factor, w * factor

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.bundle.denoiser.dtype

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
