"""Z-Image (Tongyi-MAI, Apache-2.0): a single-stream DiT (diffusers' ZImageTransformer2DModel:
two noise-refiner and two context-refiner blocks, then 30 main blocks over the image and caption
tokens together), conditioned on Qwen3-4B's second-to-last hidden layer through its chat
template, on the 16-channel Flux.1 VAE, trained with flow matching.

The transformer is called as diffusers' ZImagePipeline calls it: a list of (C, 1, H, W)
latents, the timestep as 1 - sigma, each caption's real tokens as its own tensor; it returns
a list whose negation is the flow's velocity (noise - x0), the target of `flow.FLOW_MATCHING`.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modules.config.outputs import Sampler
from modules.model_types import ModelType
from modules.models.bundle import Dtypes, ModelBundle
from modules.models.chat_text import ChatEncoding, caption_list, encode_chat
from modules.models.families.base import FileConventions, ModelFamily, RealSize, TextEmbeddings
from modules.models.families.flow import FLOW_MATCHING, load_qwen_flow_folder, qwen_text_first
from modules.models.families.sd import text_encoders
from modules.models.tiny_zimage import (TINY_ZIMAGE, build_real_size, real_size_spec,
                                        transformer_parameters)

# The blocks REGIONAL compiles: the class diffusers declares repeated
# (ZImageTransformer2DModel._repeated_blocks); the refiners are blocks of the same class.
ZIMAGE_BLOCKS = ("ZImageTransformerBlock",)
# How ZImagePipeline reads Qwen3: the second-to-last hidden layer, at most 512 tokens; lengths
# padded to 32, the transformer's own caption padding (SEQ_MULTI_OF), so padding costs nothing
# there.
ZIMAGE_TEXT = ChatEncoding(hidden_layer=-2, max_length=512, pad_multiple=32)
# LoRA goes on the main blocks only (`layers.N.`): the refiners stay as trained, as the
# reference LoRA trainers leave them.
MAIN_BLOCKS = r"layers\.\d+\."
# ZImagePipeline samples with the flow-matching Euler scheduler, built from the model's own
# scheduler config (its shift): the one sampler (model_types.py lists it for the config layer)
SAMPLERS: dict[Sampler, tuple[str, dict[str, Any]]] = {
    Sampler.EULER: ("FlowMatchEulerDiscreteScheduler", {})}


# The LoRA file ComfyUI and diffusers both read for Z-Image: the diffusers module path under
# `diffusion_model.`, LyCORIS's tensor names (`lora_down` / `lora_up` / `alpha`, `hada_*`,
# `lokr_*`). ComfyUI maps it onto its fused attention (comfy/utils.py `z_image_to_diffusers`),
# diffusers' ZImageLoraLoaderMixin folds the alpha in (`_convert_non_diffusers_z_image_lora_...`).
def _denoiser_file(path: Path) -> bool:
    from modules.models.zimage_files import is_transformer_file
    return is_transformer_file(path)


def _denoiser_file_key(key: str, rows: int) -> tuple[str, tuple[int, int] | None]:
    from modules.models.zimage_files import original_key
    return original_key(key, rows)


# The LoRA tools (modules/lora_tools) read the same record: the transformer's layers are the
# ones named (the Qwen3 text encoder is not trained with a LoRA here, so no file names it),
# its single file is ComfyUI's diffusion-model file in the original layout.
ZIMAGE_FILES = FileConventions(
    kohya_prefixes={"transformer": "diffusion_model."}, kohya_denoiser_naming="diffusers",
    kohya_separator=".", base_model_version="z_image",
    modelspec_architecture=lambda v_prediction: "z-image",
    # flow matching: neither of modelspec's prediction types (epsilon, v)
    modelspec_implementation="https://github.com/Tongyi-MAI/Z-Image",
    modelspec_prediction_type=lambda v_prediction: None,
    single_file_configs="zimage", single_file_text_encoders={},
    denoiser_class="ZImageTransformer2DModel", denoiser_file=_denoiser_file,
    denoiser_file_key=_denoiser_file_key,
    # its layers' names, which Klein's files (under the same prefix) never start with
    lora_layer_names=r"(?:layers|noise_refiner|context_refiner)\.\d+\.|(?:cap_embedder|"
                     r"all_x_embedder|all_final_layer|t_embedder)\.")


def warm_rope_tables(transformer: nn.Module) -> nn.Module:
    """Fill the transformer's rotary-embedding tables now. diffusers' RopeEmbedder builds them
    at its first call and keeps them in an attribute, so a FULL-compiled transformer would be
    traced once with the attribute unset and recompiled at the next call; built here, every
    call sees them set (they still move to the GPU at the first call there, within the first
    step). The same tables the first call would build."""
    rope: Any = transformer.rope_embedder  # diffusers' RopeEmbedder (nn.Module attributes)
    if rope.freqs_cis is None:
        rope.freqs_cis = rope.precompute_freqs_cis(rope.axes_dims, rope.axes_lens,
                                                   theta=rope.theta)
    return transformer


def load_folder(path: Path, prediction_type: Any, dtypes: Dtypes) -> ModelBundle:
    """A `ZImagePipeline` diffusers folder, each component at its dtype; never the network."""
    return load_qwen_flow_folder(path, ModelType.ZIMAGE, dtypes, "ZImageTransformer2DModel",
                                 "AutoencoderKL", prepare=warm_rope_tables)


def split_config_folder(model: Any) -> Path:
    """The config folder ComfyUI's three files are built from: model.config_path, else the
    shipped one."""
    from modules.models.single_file import config_folder_for
    return Path(model.config_path) if model.config_path else config_folder_for(ZIMAGE_FILES)


def load_split_rest(model: Any, folder: Path, dtypes: Dtypes) -> tuple[nn.Module, nn.Module]:
    from modules.models.zimage_files import load_split_rest as load_rest
    return load_rest(model, folder, dtypes)


# Qwen3 first, alone, for a run that caches every caption up front (a diffusers folder or
# ComfyUI's three files); then the rest (train/setup/text_first.py)
ZIMAGE_TEXT_FIRST = qwen_text_first(ModelType.ZIMAGE, "ZImageTransformer2DModel",
                                    "AutoencoderKL", split_config_folder, load_split_rest,
                                    prepare=warm_rope_tables)


def load_single_file(path: Path, model: Any, dtypes: Dtypes) -> ModelBundle:
    """ComfyUI's three files (model.path, model.text_encoder_path, model.vae_path), built
    from the shipped Z-Image configs (or model.config_path), the tokenizer from
    model.tokenizer_path."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from modules.models.zimage_files import load_split_files
    folder = split_config_folder(model)
    parts = load_split_files(model, folder, dtypes)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler",
                                                                local_files_only=True)
    return ModelBundle(ModelType.ZIMAGE, Path(path), warm_rope_tables(parts["transformer"]),
                       parts["vae"],
                       {"text_encoder": parts["text_encoder"]},
                       {"tokenizer": parts["tokenizer"]}, scheduler)


def input_problems(model: Any, single_file: bool) -> list:
    """ComfyUI's three files, each what its field says (single files); a Turbo model."""
    from modules.models.zimage_files import distilled_problems, split_file_problems
    return (split_file_problems(model) if single_file else []) + distilled_problems(model)


def write_single_file(bundle: ModelBundle, path: Path, metadata: dict, dtype: Any) -> Path:
    """The fine-tuned transformer as ComfyUI's diffusion-model file (the text encoder and VAE
    are not trained: the user's files of them still serve)."""
    from modules.models.zimage_files import save_transformer_file
    return save_transformer_file(bundle.denoiser, path, metadata, dtype)


def encode_text(bundle: ModelBundle, captions: list[str], device: torch.device,
                encoders: Mapping[str, nn.Module] | None = None) -> TextEmbeddings:
    """Qwen3's second-to-last hidden states of each caption's chat prompt, as ZImagePipeline
    computes them, with each caption's length."""
    return encode_chat(bundle.tokenizers["tokenizer"],
                       text_encoders(bundle, encoders)["text_encoder"], captions, device,
                       ZIMAGE_TEXT)


def conditioning(embeddings: TextEmbeddings, batch: dict, height: int, width: int
                 ) -> dict[str, Any]:
    """Each caption's real tokens, one tensor per sample (the transformer pads them itself)."""
    return {"cap_feats": caption_list(embeddings)}


def transformer_arguments(noisy: torch.Tensor, timesteps: torch.Tensor,
                          conditioning: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """ZImageTransformer2DModel(x, t, cap_feats): latents as a list of (C, 1, H, W), the
    timestep as 1 - sigma (ZImagePipeline's `(1000 - t) / 1000`)."""
    latents = list(noisy.unsqueeze(2).unbind(dim=0))
    model_time = (1000 - timesteps.to(torch.float32)) / 1000
    return (latents, model_time.to(noisy.dtype), conditioning["cap_feats"]), {}


def read_prediction(output: Any) -> torch.Tensor:
    """The velocity noise - x0: the transformer's per-sample outputs stacked and negated (it
    predicts x0 - noise; ZImagePipeline negates it before the scheduler's step)."""
    return -torch.stack(list(output.sample), dim=0).squeeze(2)


def pipeline_text_arguments(prompt: TextEmbeddings, negative: TextEmbeddings
                            ) -> dict[str, Any]:
    """ZImagePipeline's encoded prompts: each caption's real tokens, as its encode_prompt
    returns them."""
    return {"prompt_embeds": caption_list(prompt),
            "negative_prompt_embeds": caption_list(negative)}


def build_tiny(dest: Path, seed: int = 0) -> Path:
    from modules.models.tiny_zimage import build_tiny_zimage
    return build_tiny_zimage(dest, seed)


ZIMAGE = ModelFamily(
    model_type=ModelType.ZIMAGE,
    repeated_blocks=ZIMAGE_BLOCKS,
    load_folder=load_folder,
    load_single_file=load_single_file,
    encode_text=encode_text,
    conditioning=conditioning,
    denoiser_arguments=transformer_arguments,
    objective=FLOW_MATCHING,
    build_tiny=build_tiny,
    tiny_spec=lambda: TINY_ZIMAGE,
    read_prediction=read_prediction,
    lora_scope=MAIN_BLOCKS,
    samplers=SAMPLERS,
    files=ZIMAGE_FILES,
    varying_lengths=lambda conditioning: list(conditioning["cap_feats"]),
    input_problems=input_problems,
    write_single_file=write_single_file,
    pipeline_text_arguments=pipeline_text_arguments,
    text_first=ZIMAGE_TEXT_FIRST,
    real_size=RealSize("Z-Image architecture (6 B transformer, Qwen3-4B), random weights",
                       real_size_spec, build_real_size, transformer_parameters),
)
