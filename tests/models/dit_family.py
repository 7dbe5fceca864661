"""A model family that is not Stable Diffusion, for the tests: a tiny DiT-style denoiser
(diffusers' PixArtTransformer2DModel) on the tiny SD VAE and CLIP text encoder, trained on a
flow-matching target. It proves the family seam (modules/models/families): the training step,
the compile guard and the backups serve it without one line written for it.

`use_dit_family(monkeypatch)` puts it in the model-type and family tables under SD15 for one
test (both tables are restored after it): ModelType is a closed enum, and the seam is what is
tested, not a new config value.
"""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from modules.model_types import MODEL_TYPES, ModelType
from modules.models.families import FAMILIES, sd
from modules.models.families.base import ModelFamily, Objective
from modules.models.bundle import Dtypes, ModelBundle, dtype_of

SLOT = ModelType.SD15  # the table entry the test family stands in for
SPEC = dataclasses.replace(MODEL_TYPES[SLOT], label="tiny DiT (tests)",
                           pipeline_class="PixArtAlphaPipeline", builtin="",
                           denoiser="transformer", denoiser_label="Transformer")
CLIP_WIDTH = 32  # the tiny CLIP text encoder's hidden size (modules/models/tiny.py)
TRANSFORMER = {"num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4,
               "out_channels": 4, "num_layers": 2, "norm_num_groups": 4,
               "cross_attention_dim": 16, "sample_size": 8, "patch_size": 2,
               "norm_type": "ada_norm_single", "use_additional_conditions": False,
               "caption_channels": CLIP_WIDTH, "num_embeds_ada_norm": 1000}


def build_tiny(dest: Path, seed: int = 0) -> Path:
    """A diffusers folder: PixArt-style transformer, the tiny SD VAE, CLIP and tokenizer, and
    a flow-matching scheduler."""
    import diffusers

    from modules.models.tiny import TINY_SPECS, TOKENIZER_FILES, build_tiny_components

    with tempfile.TemporaryDirectory(prefix="tempera-dit-") as work:
        sd_parts = build_tiny_components(TINY_SPECS[SLOT], Path(work), seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            transformer = diffusers.PixArtTransformer2DModel(**TRANSFORMER)
        pipeline = diffusers.PixArtAlphaPipeline(
            tokenizer=sd_parts["tokenizer"], text_encoder=sd_parts["text_encoder"],
            vae=sd_parts["vae"], transformer=transformer,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000))
        pipeline.save_pretrained(dest, safe_serialization=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(work) / "tokenizer" / name, Path(dest) / "tokenizer" / name)
    return Path(dest)


def load_folder(path: Path, prediction_type, dtypes: Dtypes) -> ModelBundle:
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler,
                           PixArtTransformer2DModel)
    from transformers import AutoTokenizer, CLIPTextModel

    local = {"local_files_only": True}
    return ModelBundle(
        SLOT, Path(path),
        PixArtTransformer2DModel.from_pretrained(
            path, subfolder="transformer", torch_dtype=dtype_of(dtypes, "transformer"), **local),
        AutoencoderKL.from_pretrained(path, subfolder="vae",
                                      torch_dtype=dtype_of(dtypes, "vae"), **local),
        {"text_encoder": CLIPTextModel.from_pretrained(
            path, subfolder="text_encoder", torch_dtype=dtype_of(dtypes, "text_encoder"),
            **local)},
        {"tokenizer": AutoTokenizer.from_pretrained(path, subfolder="tokenizer", **local)},
        FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **local))


def conditioning(embeddings, batch: dict, height: int, width: int) -> dict[str, Any]:
    return {"encoder_hidden_states": embeddings.hidden}


def transformer_arguments(noisy: torch.Tensor, timesteps: torch.Tensor,
                          conditioning: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    return (noisy,), {"encoder_hidden_states": conditioning["encoder_hidden_states"],
                      "timestep": timesteps,
                      "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}


def flow_noisy_and_target(bundle: ModelBundle, latents: torch.Tensor, noise: torch.Tensor,
                          timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rectified flow: x_t = (1 - t)·x0 + t·noise, and the velocity noise − x0 as target."""
    steps = bundle.noise_scheduler.config.num_train_timesteps
    t = (timesteps.to(torch.float32) / steps).view(-1, 1, 1, 1).to(latents.dtype)
    return (1 - t) * latents + t * noise, noise - latents


FLOW_MATCHING = Objective(
    train_timesteps=lambda bundle: bundle.noise_scheduler.config.num_train_timesteps,
    noisy_and_target=flow_noisy_and_target,
)  # no DDPM SNR and no beta schedule: the options that need them are refused for it

DIT = ModelFamily(
    model_type=SLOT,
    repeated_blocks=("BasicTransformerBlock",),
    load_folder=load_folder,
    load_single_file=None,
    encode_text=sd.encode_text,
    conditioning=conditioning,
    denoiser_arguments=transformer_arguments,
    objective=FLOW_MATCHING,
    build_tiny=build_tiny,
)


def use_dit_family(monkeypatch) -> None:
    """The test family in both tables for the rest of one test."""
    monkeypatch.setitem(MODEL_TYPES, SLOT, SPEC)
    monkeypatch.setitem(FAMILIES, SLOT, DIT)
