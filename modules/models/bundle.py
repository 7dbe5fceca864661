"""A loaded model as one value: every component of a latent diffusion model, by the names its
pipeline uses, and the dtype helpers the loaders share. Plain data: it imports no loader and no
family, so every loader and family can import it."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from modules.config.schema import DType, ModelType, PredictionType
from modules.model_types import MODEL_TYPES

if TYPE_CHECKING:
    # What the components are. diffusers' classes are Any to mypy (pyproject.toml says why);
    # transformers' are typed.
    from diffusers import AutoencoderKL, ModelMixin, SchedulerMixin
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16,
                DType.BFLOAT16: torch.bfloat16}
PREDICTION_TYPES = {PredictionType.EPSILON: "epsilon", PredictionType.V_PREDICTION: "v_prediction"}


@dataclass
class ModelBundle:
    """Every component of a latent diffusion model, by the names its pipeline uses: the
    denoiser (its name is the family's, e.g. "unet"), the VAE, the text encoder(s)."""
    model_type: ModelType
    path: Path
    denoiser: ModelMixin
    vae: AutoencoderKL
    text_encoders: dict[str, PreTrainedModel]
    tokenizers: dict[str, PreTrainedTokenizerBase]
    noise_scheduler: SchedulerMixin

    @property
    def denoiser_name(self) -> str:
        return MODEL_TYPES[self.model_type].denoiser

    def component(self, name: str) -> ModelMixin | PreTrainedModel:
        if name == self.denoiser_name:
            return self.denoiser
        if name == "vae":
            return self.vae
        return self.text_encoders[name]

    def components(self) -> dict[str, ModelMixin | PreTrainedModel]:
        return {self.denoiser_name: self.denoiser, **self.text_encoders, "vae": self.vae}

    @property
    def prediction_type(self) -> str:
        """"epsilon" / "v_prediction" (DDPM), or "flow_matching" for a flow-matching scheduler,
        which has no such setting."""
        return self.noise_scheduler.config.get("prediction_type") or "flow_matching"

    @property
    def latent_downscale(self) -> int:
        """How many pixels one latent cell covers per side (8 for every SD model)."""
        return vae_downscale(self.vae)


def vae_downscale(vae: AutoencoderKL) -> int:
    """The VAE's spatial reduction: one halving per down block after the first."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def vae_latents(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    """The VAE's latents as a denoiser is trained on them: (z - shift_factor) * scaling_factor
    (the Flux.1 VAE Z-Image uses has a shift; SD's VAEs have none)."""
    shift = vae.config.get("shift_factor") or 0.0
    return (latents - shift) * vae.config.scaling_factor if shift else (
        latents * vae.config.scaling_factor)


# One dtype for every component, or a dtype per component name ("unet", "vae", "text_encoder"...)
Dtypes = torch.dtype | Mapping[str, torch.dtype]


def dtype_of(dtypes: Dtypes, name: str) -> torch.dtype:
    return dtypes if isinstance(dtypes, torch.dtype) else dtypes[name]


def widest_dtype(dtypes: Dtypes) -> torch.dtype:
    """One dtype to read a file at, so that each component is rounded once, to its own: the
    common dtype when all agree, else float32 (holds both float16 and bfloat16 exactly)."""
    if isinstance(dtypes, torch.dtype):
        return dtypes
    distinct = set(dtypes.values())
    return distinct.pop() if len(distinct) == 1 else torch.float32
