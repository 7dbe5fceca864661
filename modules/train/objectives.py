"""Small pure functions around the training objective: noise offset, the MSE, caption dropout.

The noise process, the target and loss weights (min-SNR) are the family's
(`modules/models/families`, `Objective`)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from modules.config.schema import Config
from modules.data.masks import latent_mask


def offset_noise(noise: torch.Tensor, offset_draw: torch.Tensor | None, strength: float) -> torch.Tensor:
    """Add a per-sample, per-channel constant to the noise so the model learns overall brightness.

    `offset_draw` is (B, C, 1, 1) standard normal drawn with the step's other randomness.
    """
    if not strength or offset_draw is None:
        return noise
    return noise + strength * offset_draw.to(noise.device, noise.dtype)


def diffusion_mse(prediction: torch.Tensor, target: torch.Tensor,
                  weights: torch.Tensor | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """MSE over all elements, or per-sample MSE scaled by `weights` and averaged. With a loss
    `mask` (B, 1, H, W) each sample's MSE is its mask-weighted mean (`masked_sample_mean`)."""
    if weights is None and mask is None:
        return F.mse_loss(prediction.float(), target.float())
    per_element = F.mse_loss(prediction.float(), target.float(), reduction="none")
    if mask is None:
        per_sample = per_element.mean(dim=list(range(1, per_element.ndim)))
    else:
        per_sample = masked_sample_mean(per_element, mask)
    if weights is None:
        return per_sample.mean()
    return (per_sample * weights.to(per_sample.device)).mean()


def masked_sample_mean(per_element: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sample's loss averaged over the pixels its mask keeps: sum(mask * loss) / sum(mask)
    (the mask broadcast over channels, first averaged down to the loss's size).

    Normalised by the mask's area, so a sample's loss keeps its scale however small the kept
    region is (kohya's sd-scripts multiplies without normalising, so its loss shrinks with the
    area); a sample whose mask keeps nothing contributes 0 and no gradient.
    """
    weights = latent_mask(mask.to(per_element.device), per_element.shape[-2:])
    weights = weights.to(per_element.dtype).expand_as(per_element)
    dims = list(range(1, per_element.ndim))
    kept = weights.sum(dim=dims)
    return (per_element * weights).sum(dim=dims) / kept.clamp_min(torch.finfo(kept.dtype).tiny)


def sample_weights(loss_weights: torch.Tensor | None,
                   batch_weights: torch.Tensor | None) -> torch.Tensor | None:
    """The per-sample loss weights: the objective's (min-SNR) times the batch's own (a
    regularisation image's training.prior_loss_weight); None when neither is given."""
    if batch_weights is None:
        return loss_weights
    if loss_weights is None:
        return batch_weights
    return loss_weights * batch_weights.to(loss_weights.device, loss_weights.dtype)


def drop_captions(captions: list[str], draws: torch.Tensor | None,
                  probabilities: Sequence[float]) -> list[str]:
    """Replace each caption with "" where its uniform draw falls under its own probability
    (one per sample: its dataset's caption dropout, `caption_dropouts`).

    Training on some empty captions is what makes classifier-free guidance work on the result.
    """
    if not any(probabilities) or draws is None:
        return list(captions)
    return ["" if float(u) < p else c for c, u, p in zip(captions, draws, probabilities,
                                                          strict=True)]


def caption_dropouts(config: Config, sources: Sequence[int]) -> list[float]:
    """Each sample's caption dropout: its dataset's (`data.datasets[i].caption_dropout`), or
    `data.caption_dropout` where the dataset sets none."""
    own = [config.data.caption_dropout if ds.caption_dropout is None else ds.caption_dropout
           for ds in config.data.datasets]
    return [own[source] for source in sources]
