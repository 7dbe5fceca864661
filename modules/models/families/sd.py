"""Stable Diffusion 1.x and 2.x: a UNet conditioned on one CLIP text encoder, trained on
DDPM's noise (epsilon or v-prediction, as the scheduler says). SDXL (`sdxl.py`) reuses most
of these functions."""
from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from modules.config.schema import ModelConfig, PredictionType
from modules.model_types import MODEL_TYPES, ModelType
from modules.models.families.base import (FileConventions, ModelFamily, Objective, RealSize,
                                          TextEmbeddings)
from modules.models.bundle import Dtypes, ModelBundle
from modules.models.folder import read_config
from modules.models.sd_folder import load_model

if TYPE_CHECKING:
    from diffusers import SchedulerMixin
    from transformers import PreTrainedTokenizerBase

# REGIONAL compile's blocks of a diffusers UNet2DConditionModel (matched by class name)
UNET_BLOCKS = ("BasicTransformerBlock", "ResnetBlock2D")


def tokenize(tokenizer: PreTrainedTokenizerBase, captions: list[str]) -> torch.Tensor:
    return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                     truncation=True, return_tensors="pt").input_ids


def text_encoders(bundle: ModelBundle, encoders: Mapping[str, nn.Module] | None
                  ) -> dict[str, nn.Module]:
    """The bundle's text encoders, some replaced by name from `encoders` (the trainer's
    DistributedDataParallel wrappers)."""
    return {**bundle.text_encoders, **{n: m for n, m in (encoders or {}).items()
                                       if n in bundle.text_encoders}}


def encode_text(bundle: ModelBundle, captions: list[str], device: torch.device,
                encoders: Mapping[str, nn.Module] | None = None) -> TextEmbeddings:
    """One CLIP encoder's last hidden states per caption; no pooled embedding."""
    spec = MODEL_TYPES[bundle.model_type]
    (te_name,), (tok_name,) = spec.text_encoders, spec.tokenizers
    ids = tokenize(bundle.tokenizers[tok_name], captions).to(device)
    return TextEmbeddings(text_encoders(bundle, encoders)[te_name](ids)[0])


def text_conditioning(embeddings: TextEmbeddings, batch: dict, height: int, width: int
                      ) -> dict[str, Any]:
    """SD's UNet is conditioned on the hidden states alone."""
    return {"encoder_hidden_states": embeddings.hidden, "added_cond_kwargs": None}


def unet_arguments(noisy: torch.Tensor, timesteps: torch.Tensor,
                   conditioning: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """UNet2DConditionModel(sample, timestep, encoder_hidden_states, added_cond_kwargs=…)."""
    return (noisy, timesteps, conditioning["encoder_hidden_states"]), {
        "added_cond_kwargs": conditioning["added_cond_kwargs"]}


# --- DDPM objective (SD 1.x, 2.x, SDXL) ---------------------------------------------------
def snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio alpha_bar / (1 - alpha_bar) at each timestep."""
    a = alphas_cumprod.to(timesteps.device)[timesteps].float()
    return a / (1.0 - a)


def ddpm_noisy_and_target(bundle: ModelBundle, latents: torch.Tensor, noise: torch.Tensor,
                          timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DDPM's noised latents, and the target: the noise, or v (v-prediction)."""
    scheduler = bundle.noise_scheduler
    noisy = scheduler.add_noise(latents, noise, timesteps)
    if bundle.prediction_type == "v_prediction":
        return noisy, scheduler.get_velocity(latents, noise, timesteps)
    return noisy, noise


def ddpm_snr(bundle: ModelBundle, timesteps: torch.Tensor) -> torch.Tensor:
    return snr(bundle.noise_scheduler.alphas_cumprod, timesteps)


def ddpm_zero_terminal_snr(scheduler: SchedulerMixin) -> SchedulerMixin:
    """The same DDPM scheduler with its betas rescaled so that alpha_bar at the last timestep
    is 0 (Lin et al. 2023, diffusers' `rescale_betas_zero_snr`), and "trailing" timestep
    spacing, which the samplers built from its config then use: with leading spacing a
    sampler would never start from the pure-noise timestep the model was trained on."""
    from diffusers import DDPMScheduler
    return DDPMScheduler.from_config(scheduler.config, rescale_betas_zero_snr=True,
                                     timestep_spacing="trailing")


DDPM = Objective(
    train_timesteps=lambda bundle: bundle.noise_scheduler.config.num_train_timesteps,
    noisy_and_target=ddpm_noisy_and_target,
    snr=ddpm_snr,
    zero_terminal_snr=ddpm_zero_terminal_snr,
)


# --- loading ----------------------------------------------------------------------------
def load_folder(model_type: ModelType, path: Path, prediction_type: PredictionType,
                dtypes: Dtypes) -> ModelBundle:
    return load_model(path, model_type, prediction_type, dtypes)


def load_single_file(model_type: ModelType, files: FileConventions, path: Path,
                     model: ModelConfig, dtypes: Dtypes) -> ModelBundle:
    """An original-layout (ldm) checkpoint through the shipped configs (`files`: the family's)."""
    from modules.models.single_file import config_folder_for, load_single_file_bundle
    return load_single_file_bundle(
        path, model_type, model.prediction_type, dtype=dtypes, allow_pickle=model.allow_pickle,
        tokenizer_folder=model.tokenizer_path or None,
        config_folder=model.config_path or config_folder_for(files))


def detect_folder_type(folder: Path) -> tuple[ModelType, str]:
    """(SD version, the reason in words) of a diffusers folder, from its UNet and text encoder.

    `model_index.json` names the same pipeline class for SD 1.x and 2.x, so the version comes
    from what differs between them: SDXL's UNet takes added text/time conditioning and a second
    text encoder; SD 2's text encoder is OpenCLIP (exact GELU, where SD 1's CLIP uses quick
    GELU) and its UNet projects attention inputs with linear layers. These hold for the real
    checkpoints and the built-in tiny ones alike (widths differ, the structure does not).
    """
    unet = read_config(folder, "unet")
    if unet.get("addition_embed_type") == "text_time" or (folder / "text_encoder_2").is_dir():
        return ModelType.SDXL, "its UNet takes SDXL's text/time conditioning"
    text = read_config(folder, "text_encoder")
    if text.get("hidden_act") == "gelu" or unet.get("use_linear_projection"):
        return ModelType.SD2, ("its text encoder is OpenCLIP (exact GELU) and its UNet uses "
                               "linear attention projections, as SD 2.x does")
    return ModelType.SD15, "its text encoder is CLIP ViT-L (quick GELU), as SD 1.x uses"


def build_tiny(model_type: ModelType, dest: Path, seed: int = 0) -> Path:
    from modules.models.tiny_sd import build_tiny_pipeline
    return build_tiny_pipeline(model_type, dest, seed)


def tiny_spec(model_type: ModelType) -> Any:
    """The tiny model's row of the SD spec table (read at call time: tests change it)."""
    from modules.models.tiny_sd import TINY_SPECS
    return TINY_SPECS[model_type]


def real_size(model_type: ModelType, files: FileConventions, description: str) -> RealSize:
    """The benchmark's random-weight SD model of the real size (models/tiny_sd.py builds it from
    the configs shipped for `files`)."""
    def spec() -> Any:
        from modules.models.tiny_sd import real_size_spec
        return real_size_spec(model_type, files.single_file_configs)

    def build(spec: Any, dest: Path) -> Path:
        from modules.models.tiny_sd import build_from_spec
        return build_from_spec(spec, dest, half=True)

    def denoiser_parameters(spec: Any) -> int:
        from modules.models.tiny_sd import unet_parameters
        return unet_parameters(spec)
    return RealSize(description, spec, build, denoiser_parameters)


# The original (ldm) names that other tools read, per SD version.
SD_FILES = {
    ModelType.SD15: FileConventions(
        kohya_prefixes={"unet": "lora_unet_", "text_encoder": "lora_te_"},
        kohya_denoiser_naming="diffusers", base_model_version="sd_v1",
        modelspec_architecture=lambda v_prediction: "stable-diffusion-v1",
        single_file_configs="sd15",
        single_file_text_encoders={"text_encoder": ("cond_stage_model.transformer.", "hf")},
        a1111_sd_version="SD1"),
    ModelType.SD2: FileConventions(
        kohya_prefixes={"unet": "lora_unet_", "text_encoder": "lora_te_"},
        kohya_denoiser_naming="diffusers", base_model_version="sd_v2",
        modelspec_architecture=lambda v_prediction: ("stable-diffusion-v2-768-v" if v_prediction
                                                     else "stable-diffusion-v2-512"),
        single_file_configs="sd2",
        single_file_text_encoders={"text_encoder": ("cond_stage_model.model.", "open_clip")},
        kohya_v2=True, predicts_v_by_default=True,  # SD 2's 768-v base predicts v
        a1111_sd_version="SD2"),
}


# what the benchmark's model list says of each real-size model it builds (SD 2.x: none)
REAL_SIZE_DESCRIPTIONS = {ModelType.SD15: "SD 1.5 architecture, random weights"}


def pipeline_text_arguments(prompt: TextEmbeddings, negative: TextEmbeddings
                            ) -> dict[str, Any]:
    """StableDiffusionPipeline's encoded prompts (it then runs no text encoder)."""
    return {"prompt_embeds": prompt.hidden, "negative_prompt_embeds": negative.hidden}


def sd_family(model_type: ModelType) -> ModelFamily:
    """SD 1.x or 2.x (they differ in data: text encoder and scheduler configs, not code)."""
    return ModelFamily(
        model_type=model_type,
        repeated_blocks=UNET_BLOCKS,
        load_folder=functools.partial(load_folder, model_type),
        load_single_file=functools.partial(load_single_file, model_type, SD_FILES[model_type]),
        encode_text=encode_text,
        conditioning=text_conditioning,
        denoiser_arguments=unet_arguments,
        objective=DDPM,
        build_tiny=functools.partial(build_tiny, model_type),
        tiny_spec=functools.partial(tiny_spec, model_type),
        identify_folder=detect_folder_type,
        files=SD_FILES[model_type],
        pipeline_text_arguments=pipeline_text_arguments,
        real_size=(real_size(model_type, SD_FILES[model_type], REAL_SIZE_DESCRIPTIONS[model_type])
                   if model_type in REAL_SIZE_DESCRIPTIONS else None),
    )
