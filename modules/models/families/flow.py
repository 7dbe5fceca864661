"""Flow matching (rectified flow), the objective the transformer families train on: the
noisy input is the straight line x_t = (1 - sigma) x0 + sigma noise, and the target is its
velocity, noise - x0. Timesteps are sigma * T (T = the scheduler's num_train_timesteps), the
convention of diffusers' FlowMatchEulerDiscreteScheduler, so the sampler and the step agree.

There is no DDPM signal-to-noise ratio and no beta schedule here: the loss options that need
them (min-SNR, debiased estimation, the SNR Huber schedule, zero terminal SNR, a prediction
type) are refused for flow-matching families (train/recipe/loss_checks.py).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modules.config.loss import LossConfig, TimestepSampling
from modules.models.bundle import ModelBundle
from modules.models.families.base import Objective, TextFirst


def train_timesteps(bundle: ModelBundle) -> int:
    return bundle.noise_scheduler.config.num_train_timesteps


def flow_noisy_and_target(bundle: ModelBundle, latents: torch.Tensor, noise: torch.Tensor,
                          timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x_t = (1 - sigma) x0 + sigma noise with sigma = t / T, and the velocity noise - x0."""
    sigma = (timesteps.to(torch.float32) / train_timesteps(bundle)).view(-1, 1, 1, 1)
    sigma = sigma.to(latents.device, latents.dtype)
    return (1 - sigma) * latents + sigma * noise, noise - latents


def unit_draw(normal: torch.Tensor, loss: LossConfig) -> torch.Tensor:
    """sigma before the shift, in [0, 1), from one standard normal draw per sample: its normal
    CDF (UNIFORM: uniform on [0, 1)) or the sigmoid of mean + std * draw (LOGIT_NORMAL), then
    mapped onto [min_timestep, max_timestep) / 1000 of the loss options."""
    normal = normal.to(torch.float64)
    if loss.timestep_sampling == TimestepSampling.LOGIT_NORMAL:
        u = torch.sigmoid(loss.logit_mean + loss.logit_std * normal)
    else:
        u = 0.5 * (1 + torch.erf(normal / math.sqrt(2)))
    low, high = loss.min_timestep / 1000, loss.max_timestep / 1000
    return low + (high - low) * u


def calculate_mu(image_tokens: int, scheduler_config: Mapping[str, Any]) -> float:
    """The resolution-dependent shift's exponent, as diffusers' Flux-style pipelines compute
    it (ZImagePipeline's `calculate_shift`): linear in the image's token count between the
    scheduler's base and max sequence lengths and shifts."""
    get = scheduler_config.get
    base_len, max_len = get("base_image_seq_len", 256), get("max_image_seq_len", 4096)
    base_shift, max_shift = get("base_shift", 0.5), get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_tokens * slope + base_shift - slope * base_len


def shifted(sigma: torch.Tensor, shift: float | None, mu: float | None) -> torch.Tensor:
    """sigma shifted towards noise as FlowMatchEulerDiscreteScheduler shifts its steps: by the
    exponential time shift e^mu / (e^mu + 1/sigma - 1) when `mu` is given, else by the fixed
    s·sigma / (1 + (s - 1)·sigma)."""
    if mu is not None:
        return math.exp(mu) / (math.exp(mu) + (1 / sigma.clamp_min(1e-12) - 1)) * (sigma > 0)
    if shift is None:
        raise ValueError("a flow-matching shift needs a fixed shift or mu; neither was given")
    return shift * sigma / (1 + (shift - 1) * sigma)


def flow_timesteps(bundle: ModelBundle, normal: torch.Tensor, loss: LossConfig,
                   latent_size: tuple[int, int], patch: int = 2,
                   mu_of: Callable[[int, Mapping[str, Any]], float] = calculate_mu
                   ) -> torch.Tensor:
    """The step's timesteps, sigma * T, from one normal draw per sample: `unit_draw`, then the
    shift: loss.dynamic_shift's resolution-dependent one (`mu_of` the latent's tokens of
    `patch` x `patch` and the scheduler config: the family's pipeline's formula),
    loss.timestep_shift, or the model scheduler's own `shift`."""
    config = bundle.noise_scheduler.config
    sigma = unit_draw(normal, loss)
    if loss.dynamic_shift:
        tokens = (latent_size[0] // patch) * (latent_size[1] // patch)
        sigma = shifted(sigma, None, mu_of(tokens, config))
    else:
        shift = loss.timestep_shift if loss.timestep_shift is not None else config.get("shift", 1.0)
        sigma = shifted(sigma, shift, None)
    return (sigma * train_timesteps(bundle)).to(torch.float32)


FLOW_MATCHING = Objective(train_timesteps=train_timesteps,
                          noisy_and_target=flow_noisy_and_target,
                          continuous_timesteps=flow_timesteps)


def load_qwen_text(path: Path, dtypes: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Qwen3 encoder and its tokenizer of a diffusers folder (Z-Image, Flux.2 Klein), as
    ({"text_encoder": ...}, {"tokenizer": ...}). The encoder is loaded as Qwen3Model, the
    causal LM without its head (the hidden states are the same; an untied head would be
    weights never used)."""
    from transformers import Qwen3Model

    from modules.models.bundle import dtype_of
    text_encoder = Qwen3Model.from_pretrained(path, subfolder="text_encoder",
                                              dtype=dtype_of(dtypes, "text_encoder"),
                                              local_files_only=True)
    return {"text_encoder": text_encoder}, load_qwen_tokenizer(path)


def load_qwen_tokenizer(path: Path) -> dict[str, Any]:
    """The folder's Qwen3 tokenizer, as {"tokenizer": ...}."""
    from transformers import AutoTokenizer
    return {"tokenizer": AutoTokenizer.from_pretrained(path, subfolder="tokenizer",
                                                       local_files_only=True)}


def load_qwen_flow_rest(path: Path, model_type: Any, dtypes: Any, transformer_class: str,
                        vae_class: str, tokenizers: dict[str, Any],
                        prepare: Callable[[nn.Module], nn.Module] = lambda module: module
                        ) -> ModelBundle:
    """The folder's transformer, VAE and scheduler, each at its dtype, as a bundle without
    text encoders (`tokenizers` handed in). ``prepare``: what the family does to its
    transformer once loaded."""
    import diffusers

    from modules.models.bundle import dtype_of

    local = {"local_files_only": True}
    transformer = getattr(diffusers, transformer_class).from_pretrained(
        path, subfolder="transformer", torch_dtype=dtype_of(dtypes, "transformer"), **local)
    vae = getattr(diffusers, vae_class).from_pretrained(
        path, subfolder="vae", torch_dtype=dtype_of(dtypes, "vae"), **local)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(
        path, subfolder="scheduler", **local)
    return ModelBundle(model_type, Path(path), prepare(transformer), vae, {}, dict(tokenizers),
                       scheduler)


def qwen_text_first(model_type: Any, transformer_class: str, vae_class: str,
                    split_folder: Callable[[Any], Path],
                    split_rest: Callable[[Any, Path, Any], tuple[nn.Module, nn.Module]],
                    prepare: Callable[[nn.Module], nn.Module] = lambda module: module
                    ) -> TextFirst:
    """How a Qwen3 flow family (Z-Image, Klein) loads Qwen3 first, alone: from a diffusers
    folder, or from ComfyUI's split files (`path` the diffusion-model file, Qwen3 from
    model.text_encoder_path, built from `split_folder(model)`'s configs); then the rest
    (`split_rest`: the family's diffusion model and VAE from their files). The file modules
    are imported when a loader runs: this is called while the family table is built, which
    `single_file` itself imports (importing it here would be circular)."""
    def is_single_file(path: Path) -> bool:
        from modules.models.single_file import is_single_file as single
        return single(path)

    def load_text(path: Path, model: Any, dtypes: Any) -> tuple[dict, dict]:
        from modules.models.split_files import load_split_text
        if is_single_file(path):
            return load_split_text(model, split_folder(model), dtypes)
        return load_qwen_text(path, dtypes)

    def load_rest(path: Path, model: Any, dtypes: Any, tokenizers: dict) -> ModelBundle:
        if not is_single_file(path):
            return load_qwen_flow_rest(path, model_type, dtypes, transformer_class, vae_class,
                                       tokenizers, prepare=prepare)
        import diffusers
        folder = split_folder(model)
        transformer, vae = split_rest(model, folder, dtypes)
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(
            folder, subfolder="scheduler", local_files_only=True)
        return ModelBundle(model_type, Path(path), prepare(transformer), vae, {},
                           dict(tokenizers), scheduler)

    def load_tokenizers(path: Path, model: Any) -> dict:
        from modules.models.split_files import load_tokenizer
        if is_single_file(path):
            return {"tokenizer": load_tokenizer(model, split_folder(model))}
        return load_qwen_tokenizer(path)

    return TextFirst(load_text, load_rest, load_tokenizers, split_config_folder=split_folder)


def load_qwen_flow_folder(path: Path, model_type: Any, dtypes: Any, transformer_class: str,
                          vae_class: str,
                          prepare: Callable[[nn.Module], nn.Module] = lambda module: module
                          ) -> ModelBundle:
    """A diffusers folder of a flow-matching transformer conditioned on one Qwen3 encoder
    (Z-Image, Flux.2 Klein): each component at its dtype, never the network; the transformer
    and VAE first, then the encoder (`load_qwen_text`), all held at once (a run that caches
    its captions up front loads the two parts apart instead: `ModelFamily.text_first`)."""
    bundle = load_qwen_flow_rest(path, model_type, dtypes, transformer_class, vae_class, {},
                                 prepare)
    bundle.text_encoders, bundle.tokenizers = load_qwen_text(path, dtypes)
    return bundle
