"""What one model family is to the trainer: a record of data and small functions.

The training step, the run's helpers, the compile guard and the loaders ask the family of the
run's model type (`modules.models.families.family_of`) instead of asking `if model_type == …`.
A family is composed of plain functions (most shared between the Stable Diffusion families,
see `sd.py`), not a class hierarchy: adding one is writing one record and adding it to the
table in `families/__init__.py` (docs/architecture.md, "Adding a model family").
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from modules.model_types import MODEL_TYPES, ModelType, ModelTypeSpec
from modules.models.bundle import ModelBundle

if TYPE_CHECKING:
    from diffusers import ModelMixin, SchedulerMixin

# (hidden states, pooled embedding or None) for a list of captions
TextEmbeddings = tuple[torch.Tensor, "torch.Tensor | None"]


@dataclass(frozen=True)
class Objective:
    """The noise process and what the denoiser is trained to predict.

    `noisy_and_target(bundle, latents, noise, timesteps)` gives the denoiser's input and the
    regression target; `train_timesteps(bundle)` how many integer timesteps the draws pick
    from. The rest say what the noise and loss options (config `loss`) can use, None where
    the family's noise process has no such thing, and the options that need it are refused
    for it (modules/train/recipe/loss_checks.py):
    - `snr(bundle, timesteps)`: the signal-to-noise ratio alpha_bar / (1 - alpha_bar) per
      sample, with `bundle.prediction_type` ("epsilon" / "v_prediction") the loss weights
      (min-SNR, debiased estimation) and the SNR Huber schedule are computed from;
    - `zero_terminal_snr(scheduler)`: the noise scheduler rescaled so its last timestep is
      pure noise (and stepping "trailing" when sampling).
    """
    train_timesteps: Callable[[ModelBundle], int]
    noisy_and_target: Callable[[ModelBundle, torch.Tensor, torch.Tensor, torch.Tensor],
                               tuple[torch.Tensor, torch.Tensor]]
    snr: Callable[[ModelBundle, torch.Tensor], torch.Tensor] | None = None
    zero_terminal_snr: Callable[[SchedulerMixin], SchedulerMixin] | None = None


@dataclass(frozen=True)
class FileConventions:
    """How the tools of this field name a family's files (kohya LoRAs, `modelspec.*` and
    kohya `ss_*` metadata, original-layout single files); read by models/kohya.py,
    models/metadata.py and models/single_file.py.

    - `kohya_prefixes`: component -> kohya name prefix ("lora_unet_", "lora_te1_", …);
    - `kohya_denoiser_naming`: "diffusers" module paths or the original "ldm" names;
    - `base_model_version`: kohya's `ss_base_model_version`; `kohya_v2`: its `ss_v2`;
    - `a1111_sd_version`: the "sd version" A1111's LoRA card metadata (`<lora>.json`) names;
    - `modelspec_architecture(v_prediction)`: the modelspec architecture id (no /lora);
    - `predicts_v_by_default`: what prediction type AUTO means for the family's base models;
    - `single_file_configs`: the folder under models/configs/ with its architecture configs;
    - `single_file_text_encoders`: text encoder -> (key prefix in an ldm file, "hf" or
      "open_clip" layout).
    """
    kohya_prefixes: Mapping[str, str]
    kohya_denoiser_naming: str
    base_model_version: str
    modelspec_architecture: Callable[[bool], str]
    single_file_configs: str
    single_file_text_encoders: Mapping[str, tuple[str, str]]
    kohya_v2: bool = False
    predicts_v_by_default: bool = False
    a1111_sd_version: str = "Unknown"


@dataclass(frozen=True)
class ModelFamily:
    """Everything that differs between model families, as data and functions.

    - `denoiser` / `denoiser_label` come from the model-type table (`MODEL_TYPES`), which the
      config layer reads too: the denoiser's component name ("unet") and its label ("UNet");
    - `repeated_blocks`: class names of the denoiser's blocks REGIONAL compile compiles;
    - `load_folder(path, prediction_type, dtypes)` / `load_single_file(path, config_model,
      dtypes)`: a `ModelBundle`, each component at its dtype;
    - `encode_text(bundle, captions, device, encoders)`: per-caption (hidden, pooled);
    - `conditioning(hidden, pooled, batch, height, width)`: the denoiser's conditioning inputs
      (keyword arguments of `predict`);
    - `denoiser_arguments(noisy, timesteps, conditioning)`: the denoiser's call as (args,
      kwargs), for the training step (`predict`) and "Check compilation" alike;
    - `objective`: noise, target and loss weights (`Objective`);
    - `build_tiny(dest, seed)`: a tiny randomly initialised model folder, for tests and demos;
    - `enable_gradient_checkpointing(module)` on the denoiser;
    - `fp16_vae_overflows`: the VAE's activations overflow in float16 (kept at float32 then);
    - `identify_folder(folder)`: (model type, why) of a diffusers folder whose pipeline class
      several model types share (SD 1.x and 2.x), or None when the class says enough;
    - `files`: how other tools name its files (`FileConventions`), None when it has none.
    """
    model_type: ModelType
    repeated_blocks: tuple[str, ...]
    load_folder: Callable[..., ModelBundle]
    load_single_file: Callable[..., ModelBundle] | None
    encode_text: Callable[[ModelBundle, list[str], torch.device, Mapping[str, nn.Module] | None],
                          TextEmbeddings]
    conditioning: Callable[[torch.Tensor, torch.Tensor | None, dict, int, int], dict[str, Any]]
    denoiser_arguments: Callable[[torch.Tensor, torch.Tensor, dict[str, Any]],
                                 tuple[tuple, dict[str, Any]]]
    objective: Objective
    build_tiny: Callable[[Path, int], Path]
    enable_gradient_checkpointing: Callable[[ModelMixin], None] = (
        lambda module: module.enable_gradient_checkpointing())
    fp16_vae_overflows: bool = False
    identify_folder: Callable[[Path], tuple[ModelType, str]] | None = None
    files: FileConventions | None = None

    @property
    def spec(self) -> ModelTypeSpec:
        return MODEL_TYPES[self.model_type]

    @property
    def denoiser(self) -> str:
        """The denoiser's component name in the bundle and the pipeline ("unet")."""
        return self.spec.denoiser

    def predict(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: dict[str, Any]) -> torch.Tensor:
        """The denoiser's prediction (diffusers models return it as `.sample`)."""
        args, kwargs = self.denoiser_arguments(noisy, timesteps, conditioning)
        return denoiser(*args, **kwargs).sample
