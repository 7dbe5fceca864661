"""Small pure helpers that turn the config into the objects the training loop uses."""
from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from modules.config.loss import LossConfig
from modules.config.optimizers import OPTIMIZERS
from modules.model_types import MODEL_TYPES
from modules.models.bundle import vae_downscale
from modules.train.recipe.fused import FusedBackward, per_weight_optimizer
from modules.train.recipe.schedules import lr_multiplier, schedule_shape
from modules.config.schema import (
    Config,
    Device,
    MixedPrecision,
)

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

AUTOCAST_DTYPES = {MixedPrecision.FP16: torch.float16, MixedPrecision.BF16: torch.bfloat16}


def pick_device(setting: Device) -> torch.device:
    if setting == Device.CPU or (setting == Device.AUTO and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda")


def autocast_context(config: Config, device: torch.device):
    """Autocast for mixed precision, or a no-op context when it is off."""
    dtype = AUTOCAST_DTYPES.get(config.training.mixed_precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def float32_precision(config: Config, device: torch.device) -> tuple[Callable[[], None], dict]:
    """Let float32 matrix products and convolutions on CUDA use TF32 tensor cores, or not.

    The one place a run sets torch's precision switches (`training.allow_tf32`); returns the
    function that puts them back (the GUI trains several runs in one process) and what was set,
    for run.json. Only CUDA has TF32: on the CPU the same switch would let oneDNN round float32
    matrix products, so nothing is changed there. The legacy setters are used on purpose:
    torch >= 2.9 refuses to read a TF32 state that was set through a mix of its old and new
    APIs, and inductor still reads the old ones.
    """
    allow = config.training.allow_tf32
    if device.type != "cuda":
        return (lambda: None), {"allow_tf32": allow, "applied": False,
                                "why": "TF32 exists only on CUDA GPUs"}
    previous = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision("high" if allow else "highest")
    torch.backends.cudnn.allow_tf32 = allow

    def restore() -> None:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]

    return restore, {"allow_tf32": allow, "applied": True,
                     "float32_matmul_precision": torch.get_float32_matmul_precision(),
                     "cudnn_allow_tf32": allow}


def build_optimizer(config: Config, params: dict[str, list[nn.Parameter]]) -> torch.optim.Optimizer:
    """The config's optimizer (modules/config/optimizers.py) with one parameter group per
    trained component, each at its own learning rate."""
    t = config.training
    groups = []
    for name, plist in params.items():
        lr = getattr(config.components, MODEL_TYPES[config.model.type].config_key(name)
                     ).learning_rate
        groups.append({"params": plist, "lr": t.learning_rate if lr is None else lr,
                       "name": name})
    if t.fused_backward:  # one optimizer per weight, stepped in backward (train/recipe/fused.py)
        return FusedBackward(groups, per_weight_optimizer(config), t.max_grad_norm)
    row = OPTIMIZERS[t.optimizer]
    cls = getattr(importlib.import_module(row.module), row.cls)
    return cls(groups, weight_decay=t.weight_decay, **row.options)


def optimizer_scalars(config: Config, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """What the optimizer's row logs, from its first parameter group (Prodigy: its step
    size d; read once per logged step, with the loss already on the host)."""
    group = optimizer.param_groups[0]
    return {name: float(group[name]) for name in OPTIMIZERS[config.training.optimizer].logs
            if name in group}


def build_lr_scheduler(config: Config, optimizer: torch.optim.Optimizer, total_steps: int):
    """The run's schedule (modules/train/recipe/schedules.py) as a LambdaLR: its state is the step
    count alone, so a resumed run continues the same curve."""
    shape = schedule_shape(config, total_steps)
    schedule = config.training.lr_scheduler
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(schedule, step, shape))


@dataclass(frozen=True)
class StepBudget:
    total_steps: int
    epochs: int
    batches_per_epoch: int
    steps_per_epoch: int


def step_budget(config: Config, batches_per_epoch: int) -> StepBudget:
    """How many optimizer steps and epochs the run takes (max_steps wins when set)."""
    accumulation = config.training.gradient_accumulation
    steps_per_epoch = max(1, math.ceil(batches_per_epoch / accumulation))
    if config.training.max_steps:
        total = config.training.max_steps
        epochs = math.ceil(total / steps_per_epoch)
    else:
        epochs = config.training.epochs
        total = epochs * steps_per_epoch
    return StepBudget(total, epochs, batches_per_epoch, steps_per_epoch)


@dataclass(frozen=True)
class Draws:
    """Every random number a training micro-step needs, drawn before the step runs.

    Drawing them up front makes a step a pure function of (batch, draws), so a step that is
    retried after a compile fallback sees exactly the same noise and timesteps.
    """
    vae_eps: torch.Tensor | None
    noise: torch.Tensor
    timesteps: torch.Tensor
    noise_offset: torch.Tensor    # (B, C, 1, 1), used when training.noise_offset > 0
    caption_dropout: torch.Tensor  # (B,) uniform, used when a sample's caption dropout > 0
    perturbation: torch.Tensor | None = None   # latent-shaped, when loss.input_perturbation > 0
    multires: tuple[torch.Tensor, ...] = ()    # pyramid levels, when multires noise is on
    timestep_normal: torch.Tensor | None = None  # (B,) standard normal, continuous timesteps


def draw_randomness(generator: torch.Generator, latent_shape: tuple[int, ...],
                    timestep_range: tuple[int, int], need_vae_eps: bool,
                    loss: LossConfig | None = None, continuous: bool = False) -> Draws:
    """Draw everything in a fixed order, whether or not an option uses it, so switching an
    option on does not shift the noise every other option sees. Timesteps come uniformly from
    [low, high) of `timestep_range`. The noise options' draws (`loss`) come after all of
    these and only when their option is on, so a run without them draws what it always drew;
    an objective with `continuous` timesteps (flow matching) draws one standard normal per
    sample last, which its `continuous_timesteps` turns into the step's timesteps."""
    batch, channels = latent_shape[0], latent_shape[1]
    vae_eps = torch.randn(latent_shape, generator=generator) if need_vae_eps else None
    noise = torch.randn(latent_shape, generator=generator)
    timesteps = torch.randint(*timestep_range, (batch,), generator=generator)
    offset = torch.randn((batch, channels, 1, 1), generator=generator)
    dropout = torch.rand((batch,), generator=generator)
    perturbation = (torch.randn(latent_shape, generator=generator)
                    if loss is not None and loss.input_perturbation else None)
    multires = (draw_multires_levels(generator, latent_shape, loss.multires_noise_iterations)
                if loss is not None else ())
    normal = torch.randn((batch,), generator=generator) if continuous else None
    return Draws(vae_eps, noise, timesteps, offset, dropout, perturbation, multires, normal)


def draw_multires_levels(generator: torch.Generator, latent_shape: tuple[int, ...],
                         iterations: int) -> tuple[torch.Tensor, ...]:
    """Multi-resolution noise's levels: level i is standard normal at the latent's size
    divided by r^i, r drawn from [2, 4) per level (kohya's pyramid noise), down to one cell
    on a side at most."""
    batch, channels, height, width = latent_shape
    levels = []
    for i in range(iterations):
        r = 2.0 + 2.0 * float(torch.rand((), generator=generator))
        h, w = max(1, int(height / r ** i)), max(1, int(width / r ** i))
        levels.append(torch.randn((batch, channels, h, w), generator=generator))
        if h == 1 or w == 1:
            break
    return tuple(levels)


def latent_shape(vae: AutoencoderKL, batch_size: int, height: int, width: int) -> tuple[int, ...]:
    factor = vae_downscale(vae)
    return (batch_size, vae.config.latent_channels, height // factor, width // factor)
