"""Load a model's components from a diffusers folder (or a built-in tiny model) into a bundle."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from modules.config.schema import BUILTIN_PREFIX, DType, ModelConfig, ModelType, PredictionType
from modules.model_types import MODEL_TYPES

if TYPE_CHECKING:
    from modules.models.families.base import ModelFamily

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16,
                DType.BFLOAT16: torch.bfloat16}
PREDICTION_TYPES = {PredictionType.EPSILON: "epsilon", PredictionType.V_PREDICTION: "v_prediction"}


@dataclass
class ModelBundle:
    """Every component of a latent diffusion model, by the names its pipeline uses: the
    denoiser (its name is the family's, e.g. "unet"), the VAE, the text encoder(s)."""
    model_type: ModelType
    path: Path
    denoiser: nn.Module
    vae: nn.Module
    text_encoders: dict[str, nn.Module]
    tokenizers: dict[str, object]
    noise_scheduler: object

    @property
    def denoiser_name(self) -> str:
        return MODEL_TYPES[self.model_type].denoiser

    @property
    def family(self) -> ModelFamily:
        """What this model's family does differently (modules/models/families)."""
        from modules.models.families import family_of
        return family_of(self.model_type)

    def component(self, name: str) -> nn.Module:
        if name == self.denoiser_name:
            return self.denoiser
        if name == "vae":
            return self.vae
        return self.text_encoders[name]

    def components(self) -> dict[str, nn.Module]:
        return {self.denoiser_name: self.denoiser, **self.text_encoders, "vae": self.vae}

    @property
    def prediction_type(self) -> str:
        return self.noise_scheduler.config.prediction_type

    @property
    def latent_downscale(self) -> int:
        """How many pixels one latent cell covers per side (8 for every SD model)."""
        return vae_downscale(self.vae)


def vae_downscale(vae: nn.Module) -> int:
    """The VAE's spatial reduction: one halving per down block after the first."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


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


def resolve_model_path(path: str, cache_dir: Path) -> Path:
    """The real folder behind a model path; built-in models are built once into the cache."""
    if path.startswith(BUILTIN_PREFIX):
        from modules.models.tiny import ensure_builtin_model
        return ensure_builtin_model(path, cache_dir)
    return Path(path)


def load_bundle(model_path: Path, model: ModelConfig, dtypes: Dtypes) -> ModelBundle:
    """Load a diffusers folder, or a single-file checkpoint, of `model.type`'s family, each
    component at its dtype (`train.weights.component_dtypes` says which), its noise schedule
    rescaled for zero terminal SNR when `model.zero_terminal_snr` is on (training, samples
    and saved schedulers then all use it)."""
    from modules.models.families import family_of
    from modules.models.single_file import is_single_file
    family = family_of(model.type)
    if is_single_file(model_path):
        if family.load_single_file is None:
            raise ValueError(f"{model_path}: {MODEL_TYPES[model.type].label} models load from "
                             "a diffusers folder only")
        bundle = family.load_single_file(model_path, model, dtypes)
    else:
        bundle = family.load_folder(Path(model_path), model.prediction_type, dtypes)
    if model.zero_terminal_snr:
        rescale = family.objective.zero_terminal_snr
        if rescale is None:  # refused before loading (train/loss_checks.py); said again here
            raise ValueError(f"{MODEL_TYPES[model.type].label} models have no noise schedule "
                             "to rescale for zero terminal SNR")
        bundle.noise_scheduler = rescale(bundle.noise_scheduler)
    return bundle


def load_model(path: Path, model_type: ModelType, prediction_type: PredictionType,
               dtype: Dtypes = torch.float32) -> ModelBundle:
    """Load the components of a Stable Diffusion (UNet) diffusers folder, each at its dtype;
    never from the network."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import AutoTokenizer

    spec = MODEL_TYPES[model_type]
    common = {"local_files_only": True}
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet",
                                                torch_dtype=dtype_of(dtype, "unet"), **common)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype_of(dtype, "vae"),
                                        **common)
    text_encoders: dict[str, nn.Module] = {}
    tokenizers: dict[str, object] = {}
    for te_name, tok_name in zip(spec.text_encoders, spec.tokenizers):
        cls = component_classes(model_type)[te_name]
        text_encoders[te_name] = cls.from_pretrained(path, subfolder=te_name,
                                                     torch_dtype=dtype_of(dtype, te_name), **common)
        tokenizers[tok_name] = AutoTokenizer.from_pretrained(path, subfolder=tok_name, **common)
    scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler", **common)
    if prediction_type != PredictionType.AUTO:
        scheduler.register_to_config(prediction_type=PREDICTION_TYPES[prediction_type])
    return ModelBundle(model_type, Path(path), unet, vae, text_encoders, tokenizers, scheduler)




def component_classes(model_type: ModelType) -> dict[str, type[nn.Module]]:
    """The class each component of a `model_type` folder is built as, by component name (the
    loader and the memory plan's weightless copies, train/memory_plan.py, agree on it)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    spec = MODEL_TYPES[model_type]
    # SDXL's second encoder carries the projection that gives the pooled embedding.
    encoders = {name: CLIPTextModelWithProjection if i == 1 else CLIPTextModel
                for i, name in enumerate(spec.text_encoders)}
    return {spec.denoiser: UNet2DConditionModel, **encoders, "vae": AutoencoderKL}
