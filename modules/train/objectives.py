"""Small pure functions for the training objective: noise offset, min-SNR weights, caption dropout."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def offset_noise(noise: torch.Tensor, offset_draw: torch.Tensor | None, strength: float) -> torch.Tensor:
    """Add a per-sample, per-channel constant to the noise so the model learns overall brightness.

    `offset_draw` is (B, C, 1, 1) standard normal drawn with the step's other randomness.
    """
    if not strength or offset_draw is None:
        return noise
    return noise + strength * offset_draw.to(noise.device, noise.dtype)


def snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio alpha_bar / (1 - alpha_bar) at each timestep."""
    a = alphas_cumprod.to(timesteps.device)[timesteps].float()
    return a / (1.0 - a)


def min_snr_weights(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, gamma: float,
                    prediction_type: str) -> torch.Tensor:
    """Per-sample loss weights of Min-SNR-gamma (Hang et al. 2023): min(SNR, gamma) / SNR.

    For v-prediction the MSE on v already carries a factor SNR + 1, so the weight is
    min(SNR, gamma) / (SNR + 1).
    """
    s = snr(alphas_cumprod, timesteps)
    clipped = torch.clamp(s, max=gamma)
    return clipped / (s + 1.0) if prediction_type == "v_prediction" else clipped / s


def diffusion_mse(prediction: torch.Tensor, target: torch.Tensor,
                  weights: torch.Tensor | None) -> torch.Tensor:
    """MSE over all elements, or per-sample MSE scaled by `weights` and averaged."""
    if weights is None:
        return F.mse_loss(prediction.float(), target.float())
    per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none")
    per_sample = per_sample.mean(dim=list(range(1, per_sample.ndim)))
    return (per_sample * weights.to(per_sample.device)).mean()


def drop_captions(captions: list[str], draws: torch.Tensor | None, probability: float) -> list[str]:
    """Replace each caption with "" where its uniform draw falls under `probability`.

    Training on some empty captions is what makes classifier-free guidance work on the result.
    """
    if not probability or draws is None:
        return list(captions)
    return ["" if float(u) < probability else c for c, u in zip(captions, draws)]
