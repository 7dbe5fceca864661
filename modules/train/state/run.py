"""A started run's objects and state, as typed data (`TrainingRecipe.setup` in
modules/train/recipe/recipe.py builds it; the recipe's step and loop read it), with the run's one
`state_dict` / `load_state_dict` pair (what it writes besides backups: train/outputs/writes.py)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from modules.compile import CompileEngine
from modules.config.data import shapes_vary
from modules.config.prompts import SamplePrompt
from modules.config.schema import Config
from modules.data.dataset import (EpochBatches, ImageCaptionDataset, epoch_dataloader,
                                  set_sampler_epoch)
from modules.data.feed import FeedMeter
from modules.data.latent_cache import CachedLatentDataset
from modules.events import TrainerCallbacks, TrainerCommands
from modules.models.families import ModelFamily
from modules.models.bundle import ModelBundle
from modules.train.state.backup import BackupError, BoundaryState, set_random_states
from modules.train.recipe.batch_shapes import BatchShapeLog
from modules.train.recipe.builders import StepBudget
from modules.train.recipe.distributed import Distributed, local_tensor
from modules.train.state.sharded_state import (gathered, is_sharded, shard_of,
                                              sharded_optimizer_state)
from modules.train.outputs.metrics import RunMetrics
from modules.train.outputs.record import RunRecord
from modules.train.state.training_state import TrainingState
from modules.train.recipe.text_cache import TextEncoderCache
from modules.models.families import family_of

if TYPE_CHECKING:  # imported where a run builds them, only when the option is on
    from diffusers.training_utils import EMAModel

    from modules.train.memory.offload import BlockStreamer
    from modules.train.validation.validation_set import Validator


@dataclass
class Run:
    """One training run's objects and state, owned in one place (the recipe's data).

    What a backup saves and restores (`state_dict` / `load_state_dict`, written by
    train/state/backup.py) is exactly: the trained weights in `bundle`, `optimizer`, `lr_scheduler`,
    `scaler`, `ema` and `state`. Everything else is rebuilt from the config when a run starts.
    """
    config: Config
    bundle: ModelBundle
    device: torch.device
    output_dir: Path
    record: RunRecord
    callbacks: TrainerCallbacks
    dataset: ImageCaptionDataset | CachedLatentDataset
    batches: EpochBatches  # the epoch batch sampler, built once (recipe.setup); budget counts it
    params: dict[str, list[torch.nn.Parameter]]  # trained parameters, per component
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    budget: StepBudget
    guard: CompileEngine
    dist: Distributed
    state: TrainingState
    scaler: torch.amp.GradScaler | None = None
    writer: RunMetrics = field(default_factory=RunMetrics)  # TensorBoard and W&B, when on
    ema: EMAModel | None = None
    text_cache: TextEncoderCache | None = None
    prompts: list[SamplePrompt] = field(default_factory=list)  # sample prompts, read at the start
    validator: Validator | None = None  # the held-out images, when validation is on
    offload: BlockStreamer | None = None  # model.offload_blocks' streamer, when on
    # What the training forward calls, per component: the bundle's modules, or (several
    # processes) their DistributedDataParallel wrappers. Saving and sampling use the bundle.
    forward: dict[str, torch.nn.Module] = field(default_factory=dict)
    shape_log: BatchShapeLog = field(default_factory=BatchShapeLog)
    trained: list[str] = field(default_factory=list)
    # What `recipe.setup` changed beyond the run's objects, undone in reverse order by `close`:
    # the compile engine, the float32 precision switches, hooks, TensorBoard/W&B, the lock
    undo: ExitStack = field(default_factory=ExitStack)
    boundary: BoundaryState | None = None  # the small states after the last optimizer step
    last_backup_step: int = -1
    refused_backup_step: int = -1  # a step whose backup held NaN/inf: not tried twice
    last_backup_time: float = field(default_factory=time.monotonic)
    feed: FeedMeter = field(default_factory=FeedMeter)  # how long steps waited for batches
    loader: DataLoader | None = None  # with workers: one loader whose workers outlive an epoch
    file_metadata: dict[str, str] = field(default_factory=dict)  # about the data, for saves

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
        return family_of(self.bundle.model_type)

    @property
    def trains_text_encoder(self) -> bool:
        return any(name.startswith("text_encoder") for name in self.trained)

    def loader_for_epoch(self, epoch: int, skip_batches: int = 0):
        """The DataLoader of `epoch`, over the batch sampler the step budget was counted on."""
        set_sampler_epoch(self.batches, epoch)
        options: dict[str, Any] = dict(seed=self.config.training.seed,
                                       num_workers=self.config.data.workers,
                                       pin_memory=self.device.type == "cuda")
        if skip_batches or not self.config.data.workers:  # a resumed epoch's rest: its own
            return epoch_dataloader(self.dataset, self.batches, skip_batches=skip_batches,
                                    **options)
        # Workers are started once per run, not per epoch: a short epoch (a LoRA's few dozen
        # images) would otherwise wait for their start-up every time.
        if self.loader is None:
            self.loader = epoch_dataloader(self.dataset, self.batches, persistent=True,
                                           **options)
        return self.loader

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
        """Everything a backup holds (train/state/backup.py writes it): the trained weights, the
        optimizer, LR schedule, scaler and EMA, and the small states at `boundary`. Under FSDP
        every process must call it (the shards are gathered whole, train/state/sharded_state.py);
        only rank 0's result holds them."""
        states = {"parameters": self.trained_parameters(),
                  "optimizer": self.optimizer.state_dict(),
                  "lr_scheduler": self.lr_scheduler.state_dict(),
                  "training": boundary.training, "random": boundary.random}
        if self.scaler is not None:
            states["scaler"] = self.scaler.state_dict()
        if self.ema is not None:
            states["ema"] = self.ema.state_dict()
        if self.dist.sharded:  # every process gathers its shards; rank 0 keeps the whole
            states = gathered(states, keep=self.dist.is_main)
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
                if is_sharded(param):  # FSDP: this process's shard of the whole weight
                    local_tensor(param).copy_(local_tensor(shard_of(saved[name], param)))
                else:
                    param.copy_(saved[name].to(param.device, param.dtype))
        optimizer_state = states["optimizer"]
        if self.dist.sharded:
            optimizer_state = sharded_optimizer_state(optimizer_state, self.optimizer)
        self.optimizer.load_state_dict(optimizer_state)
        self.lr_scheduler.load_state_dict(states["lr_scheduler"])
        if self.scaler is not None and "scaler" in states:
            self.scaler.load_state_dict(states["scaler"])
        if self.ema is not None and "ema" in states:
            self.ema.load_state_dict(states["ema"])
        self.state.load_state_dict(states["training"])
        set_random_states(states["random"])

    def all_params(self) -> list[torch.nn.Parameter]:
        return [p for plist in self.params.values() for p in plist]

    def current_lr(self) -> float:
        """The first parameter group's learning rate for the next step."""
        return float(self.optimizer.param_groups[0]["lr"])

    @contextmanager
    def outside_training(self) -> Iterator[None]:
        """Around a pass that is not a training step (sampling, validation): compiled code
        bypassed (another batch size, eval mode: not worth recompiling the training graphs),
        and the offloaded blocks streamed as a pass of their own (`BlockStreamer.aside`): none
        stays on the device after it, and the next step's prefetch order is training's."""
        with self.guard.bypassed(), (self.offload.aside() if self.offload is not None
                                     else nullcontext()):
            yield

    def close(self) -> None:
        self.loader = None  # its persistent workers shut down with it (refcount)
        self.undo.close()


def item_buckets(config: Config, dataset: ImageCaptionDataset | CachedLatentDataset
                 ) -> list[tuple[int, int]] | None:
    """Each item's bucket for the batch sampler, or None when buckets are off."""
    return dataset.target_sizes if shapes_vary(config.data) else None
