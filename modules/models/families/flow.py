"""Flow matching (rectified flow), the objective the transformer families train on: the
noisy input is the straight line x_t = (1 - sigma) x0 + sigma noise, and the target is its
velocity, noise - x0. Timesteps are sigma * T (T = the scheduler's num_train_timesteps), the
convention of diffusers' FlowMatchEulerDiscreteScheduler, so the sampler and the step agree.

There is no DDPM signal-to-noise ratio and no beta schedule here: the loss options that need
them (min-SNR, debiased estimation, the SNR Huber schedule, zero terminal SNR, a prediction
type) are refused for flow-matching families (train/recipe/loss_checks.py).
"""
from __future__ import annotations

import torch

from modules.models.bundle import ModelBundle
from modules.models.families.base import Objective


def train_timesteps(bundle: ModelBundle) -> int:
    return bundle.noise_scheduler.config.num_train_timesteps


def flow_noisy_and_target(bundle: ModelBundle, latents: torch.Tensor, noise: torch.Tensor,
                          timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x_t = (1 - sigma) x0 + sigma noise with sigma = t / T, and the velocity noise - x0."""
    sigma = (timesteps.to(torch.float32) / train_timesteps(bundle)).view(-1, 1, 1, 1)
    sigma = sigma.to(latents.device, latents.dtype)
    return (1 - sigma) * latents + sigma * noise, noise - latents


FLOW_MATCHING = Objective(train_timesteps=train_timesteps,
                          noisy_and_target=flow_noisy_and_target)
