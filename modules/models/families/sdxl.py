"""Stable Diffusion XL: the SD UNet and DDPM objective, conditioned on two text encoders'
penultimate hidden states, the second encoder's pooled embedding, and each image's size and
crop (`time_ids`)."""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from modules.model_types import MODEL_TYPES, ModelType
from modules.models.families import sd
from modules.models.families.base import FileConventions, ModelFamily, TextEmbeddings
from modules.models.bundle import ModelBundle


def encode_text(bundle: ModelBundle, captions: list[str], device: torch.device,
                encoders: Mapping[str, nn.Module] | None = None) -> TextEmbeddings:
    """Both encoders' penultimate hidden states, concatenated, and the second one's pooled
    (projected) embedding."""
    spec = MODEL_TYPES[bundle.model_type]
    modules = sd.text_encoders(bundle, encoders)
    hidden, pooled = [], None
    for te_name, tok_name in zip(spec.text_encoders, spec.tokenizers):
        ids = sd.tokenize(bundle.tokenizers[tok_name], captions).to(device)
        out = modules[te_name](ids, output_hidden_states=True)
        hidden.append(out.hidden_states[-2])  # SDXL conditions on the penultimate layer
        pooled = out[0]  # the last encoder's projected pooled output
    return TextEmbeddings(torch.cat(hidden, dim=-1), pooled)


def size_conditioning(batch: dict, height: int, width: int) -> dict:
    """SDXL's per-sample sizes: each image's real original size and crop, and the batch's
    (its bucket's) height and width as the target size."""
    count = len(batch["caption"])
    return {"original_size": batch["original_size"].tolist(),
            "crop_top_left": batch["crop_top_left"].tolist(),
            "target_size": [(height, width)] * count}


def sdxl_time_ids(sizes: dict, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """SDXL's size and crop conditioning: (original h, w, crop top, left, target h, w)."""
    rows = []
    for i in range(len(sizes["target_size"])):
        original = sizes["original_size"][i]
        crop = sizes["crop_top_left"][i]
        target = sizes["target_size"][i]
        rows.append([*original, *crop, *target])
    return torch.tensor(rows, device=device, dtype=dtype)


def added_conditioning(hidden: torch.Tensor, pooled: torch.Tensor, sizes: dict
                       ) -> dict[str, Any]:
    """The UNet's conditioning: hidden states plus the pooled embedding and size/crop ids."""
    time_ids = sdxl_time_ids(sizes, hidden.device, hidden.dtype)
    return {"encoder_hidden_states": hidden,
            "added_cond_kwargs": {"text_embeds": pooled, "time_ids": time_ids}}


def conditioning(embeddings: TextEmbeddings, batch: dict, height: int, width: int
                 ) -> dict[str, Any]:
    if embeddings.pooled is None:  # encode_text always gives it; the UNet cannot run without it
        raise ValueError("SDXL's UNet is conditioned on the pooled text embedding; none given")
    return added_conditioning(embeddings.hidden, embeddings.pooled,
                              size_conditioning(batch, height, width))


# sd-scripts trains SDXL on the sgm UNet, so its LoRAs carry the ldm names
SDXL_FILES = FileConventions(
    kohya_prefixes={"unet": "lora_unet_", "text_encoder": "lora_te1_",
                    "text_encoder_2": "lora_te2_"},
    kohya_denoiser_naming="ldm", base_model_version="sdxl_base_v1-0",
    modelspec_architecture=lambda v_prediction: "stable-diffusion-xl-v1-base",
    single_file_configs="sdxl",
    single_file_text_encoders={
        "text_encoder": ("conditioner.embedders.0.transformer.", "hf"),
        "text_encoder_2": ("conditioner.embedders.1.model.", "open_clip")},
    a1111_sd_version="SDXL")


def pipeline_text_arguments(prompt: TextEmbeddings, negative: TextEmbeddings
                            ) -> dict[str, Any]:
    """StableDiffusionXLPipeline's encoded prompts, pooled ones included (it then runs
    neither text encoder)."""
    return {"prompt_embeds": prompt.hidden, "negative_prompt_embeds": negative.hidden,
            "pooled_prompt_embeds": prompt.pooled,
            "negative_pooled_prompt_embeds": negative.pooled}


SDXL = ModelFamily(
    model_type=ModelType.SDXL,
    repeated_blocks=sd.UNET_BLOCKS,
    load_folder=functools.partial(sd.load_folder, ModelType.SDXL),
    load_single_file=functools.partial(sd.load_single_file, ModelType.SDXL, SDXL_FILES),
    encode_text=encode_text,
    conditioning=conditioning,
    denoiser_arguments=sd.unet_arguments,
    fp16_vae_overflows=True,
    identify_folder=sd.detect_folder_type,
    objective=sd.DDPM,
    build_tiny=functools.partial(sd.build_tiny, ModelType.SDXL),
    tiny_spec=functools.partial(sd.tiny_spec, ModelType.SDXL),
    files=SDXL_FILES,
    pipeline_text_arguments=pipeline_text_arguments,
    real_size=sd.real_size(ModelType.SDXL, SDXL_FILES, "SDXL base architecture, random weights"),
)
