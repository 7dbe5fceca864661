"""The `loss` section of the config: how the noise is drawn and how the prediction's error is
weighed (docs/noise_and_loss.md explains each option, when to use it and what it costs).

Kept beside `schema.py` (which holds the rest of the tree) so the section reads as one piece;
`training.noise_offset` and `training.min_snr_gamma` predate it and stay where they are, so
no config file needs a migration.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from modules.config.fields import setting


class LossType(str, Enum):
    MSE = "MSE"
    HUBER = "HUBER"
    SMOOTH_L1 = "SMOOTH_L1"


class TimestepSampling(str, Enum):
    UNIFORM = "UNIFORM"
    LOGIT_NORMAL = "LOGIT_NORMAL"


class HuberSchedule(str, Enum):
    CONSTANT = "CONSTANT"
    EXPONENTIAL = "EXPONENTIAL"
    SNR = "SNR"


@dataclass
class LossConfig:
    loss_type: LossType = setting(
        LossType.MSE, label="Loss", group="Training",
        help="How the error between prediction and target is measured, per element. MSE: its "
             "square. HUBER: 2c(sqrt(d^2 + c^2) - c), the pseudo-Huber loss (like the square "
             "for errors under c, like 2c·abs(d) above: outliers pull less). SMOOTH_L1: the same "
             "divided by c (like abs(d) for large errors). c is loss.huber_c, scheduled over the "
             "timesteps by loss.huber_schedule.")
    huber_c: float = setting(
        0.1, label="Huber c", group="Training", min=1e-4, max=10.0, advanced=True,
        help="HUBER / SMOOTH_L1: where the loss turns from square to linear (kohya's default "
             "0.1). Not used by MSE.")
    huber_schedule: HuberSchedule = setting(
        HuberSchedule.SNR, label="Huber schedule", group="Training", advanced=True,
        help="HUBER / SMOOTH_L1: c over the timesteps. CONSTANT: loss.huber_c throughout. "
             "EXPONENTIAL: c^(t/T), from 1 at t = 0 down to c at the last timestep. SNR: "
             "(1 - c)/(1 + sigma_t)^2 + c with sigma_t = 1/sqrt(SNR(t)): near 1 (square loss) "
             "where little noise was added, c where much was (kohya's default).")
    debiased_estimation: bool = setting(
        False, label="Debiased estimation", group="Training",
        help="Weigh each sample's loss by 1/sqrt(SNR(t)) (epsilon; sqrt(SNR)/(SNR + 1) for "
             "v-prediction, the same weight on the image error): less weight on the nearly "
             "clean timesteps. Multiplies with min-SNR when both are on.")
    min_timestep: int = setting(
        0, label="Min timestep", group="Training", min=0, max=100_000, advanced=True,
        help="Training timesteps are drawn uniformly from [min, max): the lowest one drawn. "
             "Flow-matching families (Z-Image) draw sigma from [min, max) / 1000 before the "
             "shift.")
    max_timestep: int = setting(
        1000, label="Max timestep", group="Training", min=1, max=100_000, advanced=True,
        help="One past the highest training timestep drawn; at most the model's number of "
             "training timesteps (1000 for SD 1.x, 2.x and SDXL).")
    timestep_sampling: TimestepSampling = setting(
        TimestepSampling.UNIFORM, label="Timestep sampling", group="Training",
        help="Flow-matching families (Z-Image): how each sample's noise level sigma is drawn "
             "before the shift. UNIFORM: evenly over [0, 1). LOGIT_NORMAL: the sigmoid of a "
             "normal draw (loss.logit_mean, loss.logit_std), more often mid-way than near "
             "clean or pure noise (Esser et al. 2024, SD3). DDPM families (SD, SDXL) draw "
             "integer timesteps uniformly and refuse LOGIT_NORMAL.")
    logit_mean: float = setting(
        0.0, label="Logit-normal mean", group="Training", min=-5.0, max=5.0, advanced=True,
        help="LOGIT_NORMAL: the normal draw's mean (0 centres sigma on 0.5; above 0 noisier).")
    logit_std: float = setting(
        1.0, label="Logit-normal spread", group="Training", min=0.01, max=10.0, advanced=True,
        help="LOGIT_NORMAL: the normal draw's standard deviation.")
    timestep_shift: float | None = setting(
        None, label="Timestep shift", group="Training", min=0.01, max=100.0,
        help="Flow-matching families: shift the drawn sigma towards noise, sigma' = s·sigma / "
             "(1 + (s - 1)·sigma), as the model's scheduler shifts its sampling steps. Empty: "
             "the model's own shift (its scheduler's `shift`: Z-Image Base 6, Turbo 3); 1: no "
             "shift. Not with loss.dynamic_shift.")
    dynamic_shift: bool = setting(
        False, label="Resolution-dependent shift", group="Training",
        help="Flow-matching families: shift each batch's sigma by its resolution instead of "
             "a fixed shift, as diffusers' pipelines compute it (ZImagePipeline's "
             "calculate_shift: mu grows linearly with the image's token count between the "
             "scheduler's base and max sequence lengths and shifts; sigma' = e^mu / (e^mu + "
             "1/sigma - 1)): larger images get noisier timesteps.")
    adaptive_noise_scale: float = setting(
        0.0, label="Adaptive noise scale", group="Training", min=-1.0, max=1.0, advanced=True,
        help="With training.noise_offset: each sample's and channel's offset strength becomes "
             "noise_offset + scale * abs(mean of the latent channel) (clamped at 0), so images "
             "far from mid-grey get a larger offset. 0 is off.")
    multires_noise_iterations: int = setting(
        0, label="Multi-res noise levels", group="Training", min=0, max=20,
        help="Pyramid noise: add this many levels of noise drawn at ever smaller sizes "
             "(each 2 to 4 times smaller), upsampled to the latent, then rescale to unit "
             "variance; teaches large-scale structure and contrast. 0 is off, 6 to 10 usual.")
    multires_noise_discount: float = setting(
        0.3, label="Multi-res noise discount", group="Training", min=0.0, max=1.0,
        advanced=True,
        help="Multi-res noise: level i is scaled by discount^i (kohya's default 0.3).")
    input_perturbation: float = setting(
        0.0, label="Input perturbation", group="Training", min=0.0, max=1.0,
        help="Noise the latents with noise + gamma * (fresh noise) while the target keeps the "
             "plain noise, which reduces exposure bias (Ning et al. 2023); 0 is off, 0.1 usual.")
