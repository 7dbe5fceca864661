"""Small pure functions around the training objective: noise offset, the MSE, caption dropout.

The noise process, the target and loss weights (min-SNR) are the family's
(`modules/models/families`, `Objective`)."""
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


def diffusion_mse(prediction: torch.Tensor, target: torch.Tensor,
                  weights: torch.Tensor | None) -> torch.Tensor:
    """MSE over all elements, or per-sample MSE scaled by `weights` and averaged."""
    if weights is None:
        return F.mse_loss(prediction.float(), target.float())
    per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none")
    per_sample = per_sample.mean(dim=list(range(1, per_sample.ndim)))
    return (per_sample * weights.to(per_sample.device)).mean()


def sample_weights(loss_weights: torch.Tensor | None,
                   batch_weights: torch.Tensor | None) -> torch.Tensor | None:
    """The per-sample loss weights: the objective's (min-SNR) times the batch's own (a
    regularisation image's training.prior_loss_weight); None when neither is given."""
    if batch_weights is None:
        return loss_weights
    if loss_weights is None:
        return batch_weights
    return loss_weights * batch_weights.to(loss_weights.device, loss_weights.dtype)


def drop_captions(captions: list[str], draws: torch.Tensor | None, probability: float) -> list[str]:
    """Replace each caption with "" where its uniform draw falls under `probability`.

    Training on some empty captions is what makes classifier-free guidance work on the result.
    """
    if not probability or draws is None:
        return list(captions)
    return ["" if float(u) < probability else c for c, u in zip(captions, draws)]
