"""Small pure functions around the training objective: the noise options (offset, adaptive
offset, multi-resolution noise, input perturbation), the loss per element (MSE, pseudo-Huber,
smooth L1), the per-sample timestep weights (min-SNR, debiased estimation), the reduction, and
caption dropout. docs/noise_and_loss.md gives each one's definition and when to use it.

The noise process, the target and the SNR are the family's (`modules/models/families`,
`Objective`). Every random number used here was drawn before the step (`builders.Draws`).
The loss is computed in two stages on purpose: `elementwise_loss` gives a (B, C, H, W) tensor
that a per-element weight map (masked loss) can multiply, and `diffusion_loss` reduces it with
per-sample weights (timestep weights, prior-preservation weights).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from modules.config.loss import HuberSchedule, LossConfig, LossType
from modules.data.masks import latent_mask

if TYPE_CHECKING:
    from modules.config.schema import Config
    from modules.models.families.base import Objective
    from modules.models.bundle import ModelBundle


# --- noise ------------------------------------------------------------------------------
def noise_offset_strength(latents: torch.Tensor, offset: float, adaptive_scale: float
                          ) -> float | torch.Tensor:
    """The noise offset's strength: `offset`, or with the adaptive scale one strength per
    sample and channel, offset + scale * |mean of the latent channel|, never below 0."""
    if not adaptive_scale or not offset:
        return offset
    channel_mean = latents.float().mean(dim=(2, 3), keepdim=True).abs()
    return torch.clamp(offset + adaptive_scale * channel_mean, min=0.0)


def offset_noise(noise: torch.Tensor, offset_draw: torch.Tensor | None,
                 strength: float | torch.Tensor) -> torch.Tensor:
    """Add a per-sample, per-channel constant to the noise so the model learns overall brightness.

    `offset_draw` is (B, C, 1, 1) standard normal drawn with the step's other randomness;
    `strength` a number or (B, C, 1, 1) (`noise_offset_strength`).
    """
    if offset_draw is None or (not isinstance(strength, torch.Tensor) and not strength):
        return noise
    if isinstance(strength, torch.Tensor):
        strength = strength.to(noise.device, noise.dtype)
    return noise + strength * offset_draw.to(noise.device, noise.dtype)


def multires_noise(noise: torch.Tensor, levels: tuple[torch.Tensor, ...], discount: float
                   ) -> torch.Tensor:
    """Pyramid noise: the noise plus each drawn level (smaller and smaller standard normal
    tensors) upsampled bilinearly to the noise's size and scaled by discount^i, divided by
    the sum's standard deviation so it is unit variance again. No levels: the noise."""
    if not levels:
        return noise
    size = noise.shape[-2:]
    total = noise
    for i, level in enumerate(levels):
        level = level.to(noise.device, noise.dtype)
        upsampled = F.interpolate(level, size=size, mode="bilinear", align_corners=False)
        total = total + upsampled * discount ** i
    return total / total.std()


def perturbed_noise(noise: torch.Tensor, draw: torch.Tensor | None, gamma: float
                    ) -> torch.Tensor:
    """Input perturbation: the noise the *input* is made with, noise + gamma * draw (the
    target keeps the plain noise)."""
    if draw is None or not gamma:
        return noise
    return noise + gamma * draw.to(noise.device, noise.dtype)


def step_timesteps(objective: Objective, bundle: ModelBundle, draws, loss: LossConfig,
                   latent_size) -> torch.Tensor:
    """The step's timesteps: the uniformly drawn integers (DDPM), or the objective's continuous
    ones from the step's normal draw (flow matching's shifted sigma * T). Draws without a
    normal draw (validation's fixed, evenly spaced timesteps) are used as they are: for flow
    matching, sigma = t / T unshifted."""
    if objective.continuous_timesteps is None or draws.timestep_normal is None:
        return draws.timesteps
    return objective.continuous_timesteps(bundle, draws.timestep_normal, loss,
                                          tuple(latent_size))


def noisy_input_and_target(objective: Objective, bundle: ModelBundle, latents: torch.Tensor,
                           noise: torch.Tensor, timesteps: torch.Tensor,
                           perturbation: torch.Tensor | None, gamma: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's noised input and target; with input perturbation the input is made from
    the perturbed noise while the target is the plain noise's."""
    noisy, target = objective.noisy_and_target(bundle, latents, noise, timesteps)
    if perturbation is not None and gamma:
        noisy, _ = objective.noisy_and_target(
            bundle, latents, perturbed_noise(noise, perturbation, gamma), timesteps)
    return noisy, target


# --- loss ---------------------------------------------------------------------------------
def elementwise_loss(prediction: torch.Tensor, target: torch.Tensor, kind: LossType,
                     huber_c: float | torch.Tensor = 0.1) -> torch.Tensor:
    """The loss of each element, in float32, the shape of `prediction`.

    MSE: d^2. HUBER: 2c(sqrt(d^2 + c^2) - c), the pseudo-Huber loss, about d^2 for |d| << c
    and 2c|d| for |d| >> c. SMOOTH_L1: the same divided by c, about d^2 / c and 2|d|.
    `huber_c` is a number or one per sample (B,).
    """
    prediction, target = prediction.float(), target.float()
    if kind == LossType.MSE:
        return F.mse_loss(prediction, target, reduction="none")
    c = huber_c
    if isinstance(c, torch.Tensor):
        c = c.to(prediction.device, torch.float32).view(-1, *[1] * (prediction.ndim - 1))
    pseudo = torch.sqrt((prediction - target) ** 2 + c * c) - c
    return 2 * c * pseudo if kind == LossType.HUBER else 2 * pseudo


def diffusion_loss(per_element: torch.Tensor, sample_weights: torch.Tensor | None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """The mean over all elements, or the per-sample means scaled by `sample_weights` and
    averaged. With a loss `mask` (B, 1, H, W) each sample's mean is its mask-weighted mean
    (`masked_sample_mean`)."""
    if sample_weights is None and mask is None:
        return per_element.mean()
    if mask is None:
        per_sample = per_element.mean(dim=list(range(1, per_element.ndim)))
    else:
        per_sample = masked_sample_mean(per_element, mask)
    if sample_weights is None:
        return per_sample.mean()
    return (per_sample * sample_weights.to(per_sample.device)).mean()


def huber_threshold(loss: LossConfig, timesteps: torch.Tensor, num_train_timesteps: int,
                    snr: torch.Tensor | None) -> float | torch.Tensor:
    """The Huber c of each sample: loss.huber_c (CONSTANT), c^(t/T) (EXPONENTIAL), or
    (1 - c) / (1 + sigma)^2 + c with sigma = 1/sqrt(SNR) (SNR)."""
    c = loss.huber_c
    if loss.loss_type == LossType.MSE or loss.huber_schedule == HuberSchedule.CONSTANT:
        return c
    if loss.huber_schedule == HuberSchedule.EXPONENTIAL:
        return torch.exp(math.log(c) * timesteps.float() / num_train_timesteps)
    if snr is None:
        raise ValueError("the SNR Huber schedule needs the SNR (timestep_terms computes it)")
    sigma = torch.rsqrt(snr)
    return (1.0 - c) / (1.0 + sigma) ** 2 + c


def min_snr_weights(snr: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma (Hang et al. 2023): min(SNR, gamma) / SNR on the epsilon loss. The loss on
    v carries a factor SNR + 1 on the image error where the epsilon loss carries SNR, so for
    v-prediction the same weighting is min(SNR, gamma) / (SNR + 1)."""
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1.0) if prediction_type == "v_prediction" else clipped / snr


def debiased_weights(snr: torch.Tensor, prediction_type: str) -> torch.Tensor:
    """Debiased estimation (Yu et al. 2024): 1/sqrt(SNR) on the epsilon loss, that is
    sqrt(SNR) on the image error; for v-prediction the same, sqrt(SNR) / (SNR + 1)."""
    if prediction_type == "v_prediction":
        return torch.sqrt(snr) / (snr + 1.0)
    return torch.rsqrt(snr)


def needs_snr(config: Config) -> bool:
    """Whether the loss options of `config` read the family's SNR."""
    loss = config.loss
    return bool(config.training.min_snr_gamma or loss.debiased_estimation
                or (loss.loss_type != LossType.MSE and loss.huber_schedule == HuberSchedule.SNR))


def timestep_terms(objective: Objective, bundle: ModelBundle, timesteps: torch.Tensor,
                   config: Config) -> tuple[torch.Tensor | None, float | torch.Tensor]:
    """(per-sample weights or None, the Huber c) for the drawn timesteps, on their device."""
    loss, gamma = config.loss, config.training.min_snr_gamma
    snr = None
    if needs_snr(config):
        if objective.snr is None:  # loss_checks refuses these options for such a family
            raise ValueError("these loss options need an SNR, which this family has not")
        snr = objective.snr(bundle, timesteps)
    weights = None
    if gamma and snr is not None:
        weights = min_snr_weights(snr, gamma, bundle.prediction_type)
    if loss.debiased_estimation and snr is not None:
        debiased = debiased_weights(snr, bundle.prediction_type)
        weights = debiased if weights is None else weights * debiased
    if loss.loss_type == LossType.MSE:
        return weights, loss.huber_c  # unused by MSE
    return weights, huber_threshold(loss, timesteps, objective.train_timesteps(bundle), snr)


def noise_schedule_record(bundle: ModelBundle) -> dict:
    """What run.json says of the noise schedule the run trains (and samples) with."""
    config = bundle.noise_scheduler.config
    return {"scheduler": type(bundle.noise_scheduler).__name__,
            "prediction_type": config.get("prediction_type"),
            "num_train_timesteps": config.get("num_train_timesteps"),
            "zero_terminal_snr": bool(config.get("rescale_betas_zero_snr", False)),
            "timestep_spacing": config.get("timestep_spacing")}


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
