"""Flux.2 Klein (Black Forest Labs; base 4B and 9B): an MMDiT (diffusers'
Flux2Transformer2DModel: double-stream blocks over image and caption tokens apart, then
single-stream blocks over both), conditioned on a Qwen3 causal LM (Qwen3-4B for 4B, Qwen3-8B
for 9B) read at hidden layers 9, 18 and 27 through its chat template, on the 32-channel
AutoencoderKLFlux2, trained with flow matching.

Everything here follows diffusers' Flux2KleinPipeline (pipelines/flux2/pipeline_flux2_klein.py):
- captions: the chat template with thinking off, padded to 512 tokens (the transformer attends
  to every one of them: no mask, so the padding's hidden states are part of the condition);
  the three layers stacked per token, (B, 512, 3 x width);
- latents: the VAE's (32, H/8, W/8), normalised per 2x2 patch channel by the VAE's batch-norm
  running statistics. The trainer keeps them in that (32, h, w) layout (the noise, the loss and
  the latent cache see a plain latent image); the transformer's call packs them into
  (B, h/2 x w/2, 128) tokens with their position ids, and its prediction is unpacked back;
- the transformer's timestep is sigma (the pipeline's t / 1000), no guidance embedding (the
  base models have none), and it predicts the velocity noise - x0, the target of
  `flow.FLOW_MATCHING`;
- the resolution-dependent shift (loss.dynamic_shift) is the pipeline's `compute_empirical_mu`
  of the image's token count, at the base model's default 50 sampling steps.
"""
from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modules.config.outputs import Sampler
from modules.model_types import ModelType
from modules.models.bundle import Dtypes, ModelBundle
from modules.models.chat_text import ChatEncoding, chat_prompts
from modules.models.families.base import (FileConventions, ModelFamily, Objective, RealSize,
                                          TextEmbeddings)
from modules.models.families.flow import (load_qwen_flow_folder, qwen_text_first,
                                          flow_noisy_and_target, flow_timesteps,
                                          train_timesteps)
from modules.models.families.sd import text_encoders
from modules.models.klein_files import STACKED_LAYERS
from modules.models.tiny_klein import (TINY_KLEIN, build_real_size, real_size_spec,
                                       transformer_parameters)

# The blocks REGIONAL compiles: both classes diffusers declares repeated
# (Flux2Transformer2DModel._repeated_blocks)
KLEIN_BLOCKS = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")
# How Flux2KleinPipeline reads Qwen3: thinking off, every caption padded (and cut) to 512
# tokens, hidden layers 9, 18 and 27 stacked
KLEIN_TEXT = ChatEncoding(max_length=512, enable_thinking=False)
# Flux2KleinPipeline's default step count, which its empirical mu depends on below 4300 tokens
# (about 1050 x 1050 px); the base models' sampling default
SHIFT_STEPS = 50
# LoRA goes inside the transformer blocks (double and single), not on the embedders,
# modulation or output layers
BLOCKS_SCOPE = r"(?:single_)?transformer_blocks\.\d+\."
SAMPLERS: dict[Sampler, tuple[str, dict[str, Any]]] = {
    Sampler.EULER: ("FlowMatchEulerDiscreteScheduler", {})}
PATCH = 2  # the VAE's latents are packed in 2 x 2 patches


def load_folder(path: Path, prediction_type: Any, dtypes: Dtypes) -> ModelBundle:
    """A `Flux2KleinPipeline` diffusers folder, each component at its dtype; never the network
    (the text encoder as Qwen3Model: the 8B's untied head would be 1.2 GB never used)."""
    return load_qwen_flow_folder(path, ModelType.KLEIN, dtypes, "Flux2Transformer2DModel",
                                 "AutoencoderKLFlux2")


# Qwen3 first, alone, for a run that caches every caption up front; then the rest
def split_config_folder(model: Any) -> Path:
    """The config folder ComfyUI's split files are built from: model.config_path, else the
    shipped one of the diffusion model's size."""
    from modules.models.single_file import config_folder_for
    return Path(model.config_path) if model.config_path else config_folder_for(KLEIN_FILES,
                                                                               model.path)


def load_split_rest(model: Any, folder: Path, dtypes: Dtypes) -> tuple[nn.Module, nn.Module]:
    from modules.models.klein_files import load_split_rest as load_rest
    return load_rest(model, folder, dtypes)


KLEIN_TEXT_FIRST = qwen_text_first(ModelType.KLEIN, "Flux2Transformer2DModel",
                                   "AutoencoderKLFlux2", split_config_folder, load_split_rest)


def encode_klein(tokenizer: Any, encoder: nn.Module, captions: list[str], device: torch.device
                 ) -> torch.Tensor:
    """(B, 512, 3 x width): each caption's chat prompt padded to 512 tokens, the encoder's
    hidden states 9, 18 and 27 side by side per token, as Flux2KleinPipeline's
    `_get_qwen3_prompt_embeds` computes them."""
    tokens = tokenizer(chat_prompts(tokenizer, captions, KLEIN_TEXT), padding="max_length",
                       max_length=KLEIN_TEXT.max_length, truncation=True, return_tensors="pt")
    output = encoder(input_ids=tokens.input_ids.to(device),
                     attention_mask=tokens.attention_mask.to(device),
                     output_hidden_states=True, use_cache=False)
    hidden = output.hidden_states
    if len(hidden) <= max(STACKED_LAYERS):
        raise ValueError(f"the Klein text encoder has {len(hidden) - 1} layers; "
                         f"Flux2KleinPipeline reads hidden layers {STACKED_LAYERS}")
    stacked = torch.stack([hidden[k] for k in STACKED_LAYERS], dim=1)  # (B, 3, L, D)
    batch, layers, length, width = stacked.shape
    return stacked.permute(0, 2, 1, 3).reshape(batch, length, layers * width)


def encode_text(bundle: ModelBundle, captions: list[str], device: torch.device,
                encoders: Mapping[str, nn.Module] | None = None) -> TextEmbeddings:
    """The captions as Flux2KleinPipeline conditions on them: every one 512 tokens long
    (`lengths` None: the padding is part of the condition)."""
    encoder = text_encoders(bundle, encoders)["text_encoder"]
    return TextEmbeddings(encode_klein(bundle.tokenizers["tokenizer"], encoder, captions,
                                       device))


def text_ids(length: int, device: torch.device) -> torch.Tensor:
    """The caption tokens' position ids (time, height, width, index) = (0, 0, 0, l), as
    Flux2KleinPipeline's `_prepare_text_ids`; one row serves the whole batch."""
    ids = torch.zeros(length, 4, dtype=torch.long, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


def latent_ids(height: int, width: int, device: torch.device) -> torch.Tensor:
    """The image tokens' position ids (0, row, column, 0) in packing order, as
    Flux2KleinPipeline's `_prepare_latent_ids` (for a (height, width) grid of patches)."""
    rows, columns = torch.meshgrid(torch.arange(height, device=device),
                                   torch.arange(width, device=device), indexing="ij")
    ids = torch.zeros(height * width, 4, dtype=torch.long, device=device)
    ids[:, 1], ids[:, 2] = rows.reshape(-1), columns.reshape(-1)
    return ids


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2): each 2 x 2 patch's values as channels c*4 + 2dy + dx
    (Flux2KleinPipeline's `_patchify_latents`)."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 1, 3, 5, 2, 4)
    return patches.reshape(b, c * PATCH * PATCH, h // PATCH, w // PATCH)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `patchify` (the pipeline's `_unpatchify_latents`)."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c // (PATCH * PATCH), PATCH, PATCH, h, w)
    return patches.permute(0, 1, 4, 2, 5, 3).reshape(b, c // (PATCH * PATCH), h * PATCH,
                                                      w * PATCH)


def normalised_latents(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """The VAE's (B, 32, h, w) latents normalised as Flux2KleinPipeline normalises the packed
    ones: per 2 x 2 patch channel, minus the VAE batch norm's running mean, over the square root
    of its running variance + eps; returned in the (B, 32, h, w) layout."""
    if latents.shape[-2] % PATCH or latents.shape[-1] % PATCH:
        raise ValueError(f"Flux.2 Klein packs latents in 2 x 2 patches: a latent of "
                         f"{tuple(latents.shape[-2:])} cannot be (the image's sides must be "
                         "multiples of 16 pixels)")
    patches = patchify(latents)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(patches.device, patches.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
        patches.device, patches.dtype)
    return unpatchify((patches - mean) / std)


def conditioning(embeddings: TextEmbeddings, batch: dict, height: int, width: int
                 ) -> dict[str, Any]:
    """The caption tokens (every caption of one length) and their position ids."""
    hidden = embeddings.hidden
    return {"encoder_hidden_states": hidden, "txt_ids": text_ids(hidden.shape[1], hidden.device)}


def transformer_arguments(noisy: torch.Tensor, timesteps: torch.Tensor,
                          conditioning: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Flux2Transformer2DModel's call as Flux2KleinPipeline makes it: the latents packed into
    (B, tokens, 128) with their ids, the timestep as sigma (the pipeline's t / 1000, divided
    after the cast to the latents' dtype, as there), no guidance."""
    patches = patchify(noisy)
    b, c, h, w = patches.shape
    return (), {"hidden_states": patches.reshape(b, c, h * w).permute(0, 2, 1),
                "encoder_hidden_states": conditioning["encoder_hidden_states"],
                "timestep": timesteps.to(noisy.dtype) / 1000,
                "img_ids": latent_ids(h, w, noisy.device), "txt_ids": conditioning["txt_ids"],
                "guidance": None}


def unpack_prediction(prediction: torch.Tensor, noisy: torch.Tensor) -> torch.Tensor:
    """(B, tokens, 128) back to the noisy latents' (B, 32, h, w)."""
    b, _, h, w = noisy.shape
    grid = prediction.permute(0, 2, 1).reshape(b, -1, h // PATCH, w // PATCH)
    return unpatchify(grid)


def empirical_mu(image_tokens: int, scheduler_config: Mapping[str, Any]) -> float:
    """Flux2KleinPipeline's shift exponent for an image of `image_tokens` packed tokens at its
    default step count (its own `compute_empirical_mu`, so the two never drift apart)."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    return compute_empirical_mu(image_seq_len=image_tokens, num_steps=SHIFT_STEPS)


def pipeline_text_arguments(prompt: TextEmbeddings, negative: TextEmbeddings
                            ) -> dict[str, Any]:
    """Flux2KleinPipeline's encoded prompts, as its encode_prompt returns them."""
    return {"prompt_embeds": prompt.hidden, "negative_prompt_embeds": negative.hidden}


# Klein's LoRA file in ComfyUI's layout (KOHYA output): kohya's sd-scripts names for Flux,
# `lora_unet_` + the BFL name with "_" (`lora_unet_double_blocks_0_img_attn_qkv`), LyCORIS's
# tensor names and an alpha per layer. ComfyUI maps that form for every model it loads
# (comfy/lora.py `model_lora_keys_unet`: `lora_unet_<key>` for each `diffusion_model.<key>` of
# its own state dict), and diffusers' Flux2LoraLoaderMixin reads it too
# (`_convert_kohya_flux2_lora_to_diffusers`, alpha / rank applied). The q / k / v LoRAs of a
# block are written as one LoRA of its fused `qkv` (kohya.fuse_lora).
# LoHa and LoKr have no fused form: their file names each layer as ComfyUI names diffusers'
# Flux layers, `lycoris_` + the diffusers module path with "_" (comfy/lora.py
# `model_lora_keys_unet` for Flux models, over comfy/utils.py `flux_to_diffusers`, which knows
# Flux.2's `ff.linear_in`, `attn.to_qkv_mlp_proj` and `attn.to_out`), and ComfyUI applies q /
# k / v to their rows of the fused weight itself (`calculate_weight`'s offset); diffusers'
# Flux2LoraLoaderMixin reads the LoKr one (`_convert_lycoris_flux2_lokr_to_diffusers`).
# ComfyUI's diffusion-model file is the BFL original layout (`double_blocks.N.img_attn.qkv`, ...),
# which diffusers' Flux2Transformer2DModel.from_single_file reads (klein_files.to_original_names
# writes it). The LoRA tools read the same record: the transformer's layers (no LoRA file names
# the Qwen3 encoder), its architecture from the 4B's shipped configs unless a folder is named.
def _denoiser_file(path: Path) -> bool:
    from modules.models.klein_files import is_transformer_file
    return is_transformer_file(path)


def _denoiser_file_key(key: str, rows: int) -> tuple[str, tuple[int, int] | None]:
    from modules.models.klein_files import original_key
    return original_key(key, rows)


def _single_file_sizes(path: Path) -> str | None:
    from modules.models.klein_files import size_configs
    return size_configs(path)


def _denoiser_file_stored(key: str) -> Any:
    from modules.models.klein_files import stored_as
    return stored_as(key)


KLEIN_FILES = FileConventions(
    kohya_prefixes={"transformer": "lora_unet_"}, kohya_denoiser_naming="original",
    kohya_fuses="q, k and v of each attention into one qkv projection",
    kohya_unfused_prefixes={"transformer": "lycoris_"},
    base_model_version="flux2_klein",
    modelspec_architecture=lambda v_prediction: "flux-2-klein",
    # flow matching: neither of modelspec's prediction types (epsilon, v)
    modelspec_implementation="https://github.com/black-forest-labs/flux2",
    modelspec_prediction_type=lambda v_prediction: None,
    single_file_configs="klein4b", single_file_sizes=_single_file_sizes,
    single_file_text_encoders={},
    denoiser_class="Flux2Transformer2DModel", denoiser_file=_denoiser_file,
    denoiser_file_key=_denoiser_file_key, denoiser_file_stored=_denoiser_file_stored,
    # the blocks, by diffusers' names or BFL's, which neither Z-Image's files (`transformer.`
    # too) nor SD's (`lora_unet_` too) use
    lora_layer_names=r"(?:single_transformer_blocks|transformer_blocks|double_blocks|"
                     r"single_blocks)[._]\d+[._]")


def write_single_file(bundle: ModelBundle, path: Path, metadata: dict, dtype: Any) -> Path:
    """The fine-tuned transformer as ComfyUI's diffusion-model file, BFL's layout (the text
    encoder and VAE are not trained: the user's files of them still serve)."""
    from modules.models.klein_files import save_transformer_file
    return save_transformer_file(bundle.denoiser, path, metadata, dtype)


def load_single_file(path: Path, model: Any, dtypes: Dtypes) -> ModelBundle:
    """ComfyUI's three files (model.path, model.text_encoder_path, model.vae_path), built from
    the shipped configs of the diffusion model's size (or model.config_path), the tokenizer
    from model.tokenizer_path."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from modules.models.klein_files import load_split_files
    folder = split_config_folder(model)
    parts = load_split_files(model, folder, dtypes)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler",
                                                                local_files_only=True)
    return ModelBundle(ModelType.KLEIN, Path(path), parts["transformer"], parts["vae"],
                       {"text_encoder": parts["text_encoder"]},
                       {"tokenizer": parts["tokenizer"]}, scheduler)


def input_problems(model: Any, single_file: bool) -> list:
    from modules.models.klein_files import input_problems as klein_problems
    return klein_problems(model, single_file)


def build_tiny(dest: Path, seed: int = 0) -> Path:
    from modules.models.tiny_klein import build_tiny_klein
    return build_tiny_klein(dest, seed)


# Flux matching with the pipeline's shift: the latents are (32, h, w), so an image token is a
# 2 x 2 patch of them (patch=2), the count the pipeline's `latents.shape[1]` gives
KLEIN_FLOW = Objective(train_timesteps=train_timesteps, noisy_and_target=flow_noisy_and_target,
                       continuous_timesteps=partial(flow_timesteps, patch=PATCH,
                                                    mu_of=empirical_mu))

KLEIN = ModelFamily(
    model_type=ModelType.KLEIN,
    repeated_blocks=KLEIN_BLOCKS,
    load_folder=load_folder,
    load_single_file=load_single_file,
    encode_text=encode_text,
    conditioning=conditioning,
    denoiser_arguments=transformer_arguments,
    objective=KLEIN_FLOW,
    build_tiny=build_tiny,
    tiny_spec=lambda: TINY_KLEIN,
    lora_scope=BLOCKS_SCOPE,
    samplers=SAMPLERS,
    input_problems=input_problems,
    files=KLEIN_FILES,
    write_single_file=write_single_file,
    pipeline_text_arguments=pipeline_text_arguments,
    negative_prompt_encoded_only=True,
    vae_latents=normalised_latents,
    unpack_prediction=unpack_prediction,
    text_first=KLEIN_TEXT_FIRST,
    real_size=RealSize("Flux.2 Klein 4B architecture (4 B transformer, Qwen3-4B), random "
                       "weights", real_size_spec, build_real_size, transformer_parameters),
)
