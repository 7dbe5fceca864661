"""Load a model's components from a diffusers folder (or a built-in tiny model) into a bundle."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from modules.config.schema import BUILTIN_PREFIX, DType, ModelType, PredictionType
from modules.model_types import MODEL_TYPES

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.FLOAT16: torch.float16,
                DType.BFLOAT16: torch.bfloat16}
PREDICTION_TYPES = {PredictionType.EPSILON: "epsilon", PredictionType.V_PREDICTION: "v_prediction"}


@dataclass
class ModelBundle:
    """Every component of a Stable Diffusion-style model, by the names the pipeline uses."""
    model_type: ModelType
    path: Path
    unet: nn.Module
    vae: nn.Module
    text_encoders: dict[str, nn.Module]
    tokenizers: dict[str, object]
    noise_scheduler: object

    def component(self, name: str) -> nn.Module:
        if name == "unet":
            return self.unet
        if name == "vae":
            return self.vae
        return self.text_encoders[name]

    def components(self) -> dict[str, nn.Module]:
        return {"unet": self.unet, **self.text_encoders, "vae": self.vae}

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


def load_model(path: Path, model_type: ModelType, prediction_type: PredictionType,
               dtype: Dtypes = torch.float32) -> ModelBundle:
    """Load the components of a diffusers folder, each at its dtype; never from the network."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

    spec = MODEL_TYPES[model_type]
    common = {"local_files_only": True}
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet",
                                                torch_dtype=dtype_of(dtype, "unet"), **common)
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=dtype_of(dtype, "vae"),
                                        **common)
    text_encoders: dict[str, nn.Module] = {}
    tokenizers: dict[str, object] = {}
    for i, (te_name, tok_name) in enumerate(zip(spec.text_encoders, spec.tokenizers)):
        # SDXL's second encoder carries the projection that gives the pooled embedding.
        cls = CLIPTextModelWithProjection if i == 1 else CLIPTextModel
        text_encoders[te_name] = cls.from_pretrained(path, subfolder=te_name,
                                                     torch_dtype=dtype_of(dtype, te_name), **common)
        tokenizers[tok_name] = AutoTokenizer.from_pretrained(path, subfolder=tok_name, **common)
    scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler", **common)
    if prediction_type != PredictionType.AUTO:
        scheduler.register_to_config(prediction_type=PREDICTION_TYPES[prediction_type])
    return ModelBundle(model_type, Path(path), unet, vae, text_encoders, tokenizers, scheduler)


def tokenize(tokenizer, captions: list[str]) -> torch.Tensor:
    return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                     truncation=True, return_tensors="pt").input_ids


def encode_text(bundle: ModelBundle, captions: list[str], device: torch.device,
                encoders: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-caption text conditioning: hidden states, and (SDXL) the pooled embedding.

    `encoders` may stand in for some of the bundle's text encoders by name (the trainer's
    DistributedDataParallel wrappers); the others are the bundle's.
    """
    spec = MODEL_TYPES[bundle.model_type]
    encoders = {**bundle.text_encoders, **{n: m for n, m in (encoders or {}).items()
                                           if n in bundle.text_encoders}}
    if bundle.model_type != ModelType.SDXL:
        (te_name,), (tok_name,) = spec.text_encoders, spec.tokenizers
        ids = tokenize(bundle.tokenizers[tok_name], captions).to(device)
        return encoders[te_name](ids)[0], None
    hidden, pooled = [], None
    for te_name, tok_name in zip(spec.text_encoders, spec.tokenizers):
        ids = tokenize(bundle.tokenizers[tok_name], captions).to(device)
        out = encoders[te_name](ids, output_hidden_states=True)
        hidden.append(out.hidden_states[-2])  # SDXL conditions on the penultimate layer
        pooled = out[0]  # the last encoder's projected pooled output
    return torch.cat(hidden, dim=-1), pooled


def unet_conditioning(hidden: torch.Tensor, pooled: torch.Tensor | None,
                      sizes: dict | None) -> tuple[torch.Tensor, dict | None]:
    """The UNet's conditioning inputs: hidden states plus SDXL's added embeddings.

    `sizes` (SDXL) holds per-sample original_size, crop_top_left and target_size pairs.
    """
    if pooled is None:
        return hidden, None
    time_ids = sdxl_time_ids(sizes, hidden.device, hidden.dtype)
    return hidden, {"text_embeds": pooled, "time_ids": time_ids}


def sdxl_time_ids(sizes: dict, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """SDXL's size and crop conditioning: (original h, w, crop top, left, target h, w)."""
    rows = []
    for i in range(len(sizes["target_size"])):
        original = sizes["original_size"][i]
        crop = sizes["crop_top_left"][i]
        target = sizes["target_size"][i]
        rows.append([*original, *crop, *target])
    return torch.tensor(rows, device=device, dtype=dtype)
