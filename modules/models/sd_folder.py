"""Load a Stable Diffusion (UNet) diffusers folder: SD 1.x, 2.x and SDXL, the loader the SD
families' `load_folder` calls, and the component classes the memory plan builds weightless."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from modules.config.schema import ModelType, PredictionType
from modules.model_types import MODEL_TYPES
from modules.models.bundle import PREDICTION_TYPES, Dtypes, ModelBundle, dtype_of

if TYPE_CHECKING:
    from diffusers import ModelMixin
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def load_model(path: Path, model_type: ModelType, prediction_type: PredictionType,
               dtype: Dtypes = torch.float32) -> ModelBundle:
    """Load the components of a Stable Diffusion (UNet) diffusers folder, each at its dtype;
    never from the network."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import AutoTokenizer

    spec = MODEL_TYPES[model_type]
    common: dict[str, Any] = {"local_files_only": True}
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet",
                                                torch_dtype=dtype_of(dtype, "unet"), **common)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype_of(dtype, "vae"),
                                        **common)
    text_encoders: dict[str, PreTrainedModel] = {}
    tokenizers: dict[str, PreTrainedTokenizerBase] = {}
    for te_name, tok_name in zip(spec.text_encoders, spec.tokenizers):
        cls = component_classes(model_type)[te_name]
        text_encoders[te_name] = cls.from_pretrained(path, subfolder=te_name,
                                                     torch_dtype=dtype_of(dtype, te_name), **common)
        tokenizers[tok_name] = AutoTokenizer.from_pretrained(path, subfolder=tok_name, **common)
    scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler", **common)
    if prediction_type != PredictionType.AUTO:
        scheduler.register_to_config(prediction_type=PREDICTION_TYPES[prediction_type])
    return ModelBundle(model_type, Path(path), unet, vae, text_encoders, tokenizers, scheduler)


def component_classes(model_type: ModelType
                      ) -> dict[str, type[ModelMixin] | type[PreTrainedModel]]:
    """The class each component of a `model_type` folder is built as, by component name (the
    loader and the memory plan's weightless copies, train/memory/memory_plan.py, agree on it)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    spec = MODEL_TYPES[model_type]
    # SDXL's second encoder carries the projection that gives the pooled embedding.
    encoders = {name: CLIPTextModelWithProjection if i == 1 else CLIPTextModel
                for i, name in enumerate(spec.text_encoders)}
    return {spec.denoiser: UNet2DConditionModel, **encoders, "vae": AutoencoderKL}
