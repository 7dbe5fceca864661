"""What one model family is to the trainer: a record of data and small functions.

The training step, the run's helpers, the compile guard and the loaders ask the family of the
run's model type (`modules.models.families.family_of`) instead of asking `if model_type == …`.
A family is composed of plain functions (most shared between the Stable Diffusion families,
see `sd.py`), not a class hierarchy: adding one is writing one record and adding it to the
table in `families/__init__.py` (docs/architecture.md, "Adding a model family").
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from modules.model_types import MODEL_TYPES, ModelType, ModelTypeSpec
from modules.models.bundle import ModelBundle, vae_latents


if TYPE_CHECKING:
    from diffusers import ModelMixin, SchedulerMixin

class TextEmbeddings(NamedTuple):
    """A list of captions encoded: `hidden` (B, L, D), the pooled embedding (B, D) or None,
    and for families whose captions keep their own length (Qwen3 chat encoders) `lengths`
    (B,) of each caption's real tokens, `hidden` zero-padded past them; None where every
    caption is padded to the encoder's full length and conditions the denoiser so (CLIP)."""
    hidden: torch.Tensor
    pooled: torch.Tensor | None = None
    lengths: torch.Tensor | None = None


def model_output_sample(output: Any) -> torch.Tensor:
    """The prediction in a diffusers model's output (`.sample`)."""
    return output.sample


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
      pure noise (and stepping "trailing" when sampling);
    - `continuous_timesteps(bundle, normal, loss, latent_size)`: for an objective whose
      timesteps are continuous (flow matching's sigma * T), the step's timesteps from one
      standard normal draw per sample, the loss options and the latent's (height, width);
      None: the integer timesteps drawn uniformly are the step's (DDPM).
    """
    train_timesteps: Callable[[ModelBundle], int]
    noisy_and_target: Callable[[ModelBundle, torch.Tensor, torch.Tensor, torch.Tensor],
                               tuple[torch.Tensor, torch.Tensor]]
    snr: Callable[[ModelBundle, torch.Tensor], torch.Tensor] | None = None
    zero_terminal_snr: Callable[[SchedulerMixin], SchedulerMixin] | None = None
    continuous_timesteps: Callable[..., torch.Tensor] | None = None


# modelspec.implementation of SD and SDXL files in the original layout
STABILITY_IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"


def epsilon_or_v(v_prediction: bool) -> str | None:
    """modelspec.prediction_type of a DDPM family: "v" or "epsilon"."""
    return "v" if v_prediction else "epsilon"


@dataclass(frozen=True)
class FileConventions:
    """How the tools of this field name a family's files (kohya LoRAs, `modelspec.*` and
    kohya `ss_*` metadata, original-layout single files); read by models/kohya.py,
    models/metadata.py and models/single_file.py.

    - `kohya_prefixes`: component -> kohya name prefix ("lora_unet_", "lora_te1_", …);
    - `kohya_denoiser_naming`: "diffusers" module paths, the original "ldm" names, or the
      names of the family's lone denoiser file ("original": `denoiser_file_key`, whose fused
      layers, Klein's q / k / v, are written as one LoRA of the fused weight);
    - `kohya_fuses`: what that file fuses, in words, for a family whose kohya layout fuses
      layers ("" none): LoHa / LoKr / DoRA layers have no fused form, so are refused there
      unless `kohya_unfused_prefixes` names another layout for them;
    - `kohya_unfused_prefixes`: component -> the prefix under which a family whose kohya
      layout fuses layers writes a component whose adapters are not all LoRA (LoHa, LoKr),
      each layer under its diffusers module path with "_" (ComfyUI's names for
      diffusers-named Flux layers, `lycoris_transformer_blocks_0_attn_to_q`: the reader
      applies q / k / v to their rows of the fused weight itself); {} none (refused). DoRA
      is refused even so: its update rescales each row of W + dW by the base weight's norm,
      which a reader applying it to a fused weight's row block was not checked to compute
      alike;
    - `base_model_version`: kohya's `ss_base_model_version`; `kohya_v2`: its `ss_v2`;
    - `a1111_sd_version`: the "sd version" A1111's LoRA card metadata (`<lora>.json`) names;
    - `modelspec_architecture(v_prediction)`: the modelspec architecture id (no /lora);
    - `modelspec_implementation`: modelspec's implementation URL of a file in the family's
      original layout (a kohya LoRA, a single file; a diffusers-layout file says "diffusers");
    - `modelspec_prediction_type(v_prediction)`: modelspec's prediction type ("epsilon" or
      "v"), None for a family whose objective is neither (flow matching): the key is then
      left out, as kohya's writer does for Flux, rather than naming a wrong one;
    - `predicts_v_by_default`: what prediction type AUTO means for the family's base models;
    - `single_file_configs`: the folder under models/configs/ with its architecture configs;
      `single_file_sizes(path)`: for a family of several sizes, the one a single file is of
      (Klein's 4B or 9B, by its diffusion model's header), None: `single_file_configs`;
    - `single_file_text_encoders`: text encoder -> (key prefix in an ldm file, "hf" or
      "open_clip" layout);
    - `kohya_separator`: what joins a module path's parts in a LoRA name: "_" as kohya writes
      SD's (`lora_unet_down_blocks_0_…`), "." where the readers expect the diffusers path as
      it is (ComfyUI's and diffusers' Z-Image loaders: `diffusion_model.layers.0.attention.to_q`).
    - `denoiser_class`: the diffusers class of the denoiser, which the LoRA tools build on the
      meta device from a base's config to learn its layers' names and shapes;
    - `denoiser_file(path)`: whether a `.safetensors` file is this family's lone denoiser file
      (ComfyUI's `diffusion_models/` kind), None where the family has no such file;
    - `denoiser_file_key(tensor key, rows)`: where a diffusers denoiser tensor (of `rows`
      rows) sits in that file: its key and, for a projection fused with others there, its
      rows of the fused tensor (None: all of it);
    - `denoiser_file_stored(tensor key)`: for a tensor whose values that file stores
      rearranged, the function that rearranges them, which is its own inverse (Flux's final
      modulation, (shift, scale) there and (scale, shift) in diffusers); None: as they are;
    - `lora_layer_names`: a regular expression a denoiser layer's name in the family's LoRA
      files (after the kohya prefix or the diffusers component) starts with, which tells
      apart families whose files share a prefix (Z-Image's `layers.`, Klein's blocks); None:
      any name.
    """
    kohya_prefixes: Mapping[str, str]
    kohya_denoiser_naming: str
    base_model_version: str
    modelspec_architecture: Callable[[bool], str]
    single_file_configs: str
    single_file_text_encoders: Mapping[str, tuple[str, str]]
    kohya_v2: bool = False
    predicts_v_by_default: bool = False
    modelspec_implementation: str = STABILITY_IMPLEMENTATION
    modelspec_prediction_type: Callable[[bool], str | None] = epsilon_or_v
    a1111_sd_version: str = "Unknown"
    kohya_separator: str = "_"
    denoiser_class: str = "UNet2DConditionModel"
    denoiser_file: Callable[[Path], bool] | None = None
    denoiser_file_key: Callable[[str, int], tuple[str, tuple[int, int] | None]] | None = None
    denoiser_file_stored: Callable[[str], Callable[[torch.Tensor], torch.Tensor] | None] = (
        lambda key: None)
    lora_layer_names: str | None = None
    kohya_fuses: str = ""
    kohya_unfused_prefixes: Mapping[str, str] = field(default_factory=dict)
    single_file_sizes: Callable[[Path], str | None] | None = None


@dataclass(frozen=True)
class RealSize:
    """The family at its real size with random weights, which the benchmark builds locally
    (modules/bench/models.py lists it under the model type's `cli_name`):
    - `description`: what the benchmark's model list says of it;
    - `spec()`: its architecture, from the shipped configs, in the tiny model's layout;
    - `build(spec, dest)`: a folder of the model `spec` describes, in the dtype the family's
      models are released in (a real-size one in float32 would be twice the size);
    - `denoiser_parameters(spec)`: the denoiser's parameter count for a spec in that layout
      (the tiny one's too), counted on the meta device."""
    description: str
    spec: Callable[[], Any]
    build: Callable[[Any, Path], Path]
    denoiser_parameters: Callable[[Any], int]


@dataclass(frozen=True)
class TextFirst:
    """How a family loads its text encoder apart from the rest, so that a run whose captions
    are all cached up front encodes them, releases the encoder and only then loads the denoiser
    (the text encoder and the denoiser are never in RAM together; train/setup/text_first.py):
    - `load_text(path, model config, dtypes)`: (text encoders, tokenizers) by the pipeline's
      names, nothing else read;
    - `load_rest(path, model config, dtypes, tokenizers)`: the `ModelBundle` without its text
      encoders (`text_encoders` empty), the tokenizers handed in;
    - `load_tokenizers(path, model config)`: the tokenizers alone, for a run whose captions
      are all cached already (the encoder is then not loaded at all);
    - `split_config_folder(model config)`: for a family whose ComfyUI split files load text
      first too (the three functions above then take `path`, the diffusion-model file, and
      read model.text_encoder_path etc.), the config folder the files are built from; None:
      single files load together."""
    load_text: Callable[[Path, Any, Any], tuple[dict[str, Any], dict[str, Any]]]
    load_rest: Callable[[Path, Any, Any, dict[str, Any]], ModelBundle]
    load_tokenizers: Callable[[Path, Any], dict[str, Any]]
    split_config_folder: Callable[[Any], Path] | None = None


@dataclass(frozen=True)
class ModelFamily:
    """Everything that differs between model families, as data and functions.

    - `denoiser` / `denoiser_label` come from the model-type table (`MODEL_TYPES`), which the
      config layer reads too: the denoiser's component name ("unet") and its label ("UNet");
    - `repeated_blocks`: class names of the denoiser's blocks REGIONAL compile compiles;
    - `load_folder(path, prediction_type, dtypes)` / `load_single_file(path, config_model,
      dtypes)`: a `ModelBundle`, each component at its dtype;
    - `encode_text(bundle, captions, device, encoders)`: the captions' `TextEmbeddings`;
    - `conditioning(embeddings, batch, height, width)`: the denoiser's conditioning inputs
      (keyword arguments of `predict`);
    - `denoiser_arguments(noisy, timesteps, conditioning)`: the denoiser's call as (args,
      kwargs), for the training step (`predict`) and "Check compilation" alike;
    - `read_prediction(output)`: the prediction, as the objective's target is defined, from
      what the denoiser returned (diffusers' `.sample`; Z-Image's is a list, negated);
    - `samplers`: sampler -> (diffusers scheduler class, settings) for a family whose
      pipeline samples with schedulers of its own (flow matching's Euler), None: the DDPM
      samplers (train/outputs/sampling.py);
    - `pipeline_text_arguments(prompt, negative)`: the pipeline's keyword arguments that hand
      it encoded prompts (`prompt_embeds`, ...), so samples need no text encoder on the GPU;
      a family that has it lets its text encoder leave the GPU once every caption is cached
      (None: the encoder stays);
    - `negative_prompt_encoded_only`: the pipeline takes no negative prompt as text (only
      encoded: Flux2KleinPipeline), so samples hand it both prompts encoded by the family even
      when no caption is cached;
    - `varying_lengths(conditioning)`: the conditioning tensors whose first dimension is a
      caption's own length (Z-Image's `cap_feats`), marked dynamic up front for a compiled
      denoiser; none for a family that pads every caption to one length;
    - `input_problems(model config, single_file)`: what is wrong with the model's files
      beyond what the shared checks see (Z-Image: its three ComfyUI files, a Turbo model),
      before anything is written; None: nothing more;
    - `write_single_file(bundle, path, metadata, dtype)`: the fine-tuned model as one file
      other tools load, when it is not the SD ldm layout (`files`); None: that layout;
    - `lora_scope`: a regular expression the path of an adapted layer must start with (the
      main blocks of a transformer whose refiner blocks keep their weights), None: anywhere;
    - `objective`: noise, target and loss weights (`Objective`);
    - `build_tiny(dest, seed)`: a tiny randomly initialised model folder, for tests and demos
      (its `builtin:` name is the model-type table's); `tiny_spec()`: what decides that
      model's weights and layout, whose fingerprint names its cached folder (models/tiny.py);
    - `enable_gradient_checkpointing(module)` on the denoiser;
    - `fp16_vae_overflows`: the VAE's activations overflow in float16 (kept at float32 then);
    - `identify_folder(folder)`: (model type, why) of a diffusers folder whose pipeline class
      several model types share (SD 1.x and 2.x), or None when the class says enough;
    - `files`: how other tools name its files (`FileConventions`), None when it has none;
    - `real_size`: the benchmark's random-weight model at the real size (`RealSize`), None
      where the benchmark has none.
    - `vae_latents(vae, z)`: the VAE's latents (B, C, h, w) as the denoiser is trained on
      them (default: `(z - shift_factor) * scaling_factor`; Flux.2: its batch-norm statistics);
    - `unpack_prediction(prediction, noisy)`: the prediction back in the noisy latents'
      layout, for a denoiser that takes them packed into tokens (Flux.2: (B, tokens, C) to
      (B, C, h, w)); None: `read_prediction` gives that layout already.
    - `text_first`: loading the text encoder apart from the rest (`TextFirst`), for a family
      whose encoder is as large as its denoiser's share of RAM (the Qwen3 families); None: the
      whole bundle loads at once.
    """
    model_type: ModelType
    repeated_blocks: tuple[str, ...]
    load_folder: Callable[..., ModelBundle]
    load_single_file: Callable[..., ModelBundle] | None
    encode_text: Callable[[ModelBundle, list[str], torch.device, Mapping[str, nn.Module] | None],
                          TextEmbeddings]
    conditioning: Callable[[TextEmbeddings, dict, int, int], dict[str, Any]]
    denoiser_arguments: Callable[[torch.Tensor, torch.Tensor, dict[str, Any]],
                                 tuple[tuple, dict[str, Any]]]
    objective: Objective
    build_tiny: Callable[[Path, int], Path]
    tiny_spec: Callable[[], Any]
    enable_gradient_checkpointing: Callable[[ModelMixin], None] = (
        lambda module: module.enable_gradient_checkpointing())
    fp16_vae_overflows: bool = False
    identify_folder: Callable[[Path], tuple[ModelType, str]] | None = None
    files: FileConventions | None = None
    read_prediction: Callable[[Any], torch.Tensor] = model_output_sample
    lora_scope: str | None = None
    samplers: Mapping[Any, tuple[str, dict]] | None = None
    pipeline_text_arguments: Callable[[TextEmbeddings, TextEmbeddings], dict[str, Any]] | None = None
    negative_prompt_encoded_only: bool = False
    varying_lengths: Callable[[dict[str, Any]], list[torch.Tensor]] = lambda conditioning: []
    input_problems: Callable[[Any, bool], list[Any]] | None = None
    write_single_file: Callable[..., Path] | None = None
    real_size: RealSize | None = None
    vae_latents: Callable[[Any, torch.Tensor], torch.Tensor] = vae_latents
    unpack_prediction: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    text_first: TextFirst | None = None

    @property
    def spec(self) -> ModelTypeSpec:
        return MODEL_TYPES[self.model_type]

    @property
    def denoiser(self) -> str:
        """The denoiser's component name in the bundle and the pipeline ("unet")."""
        return self.spec.denoiser

    def predict(self, denoiser: nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
                conditioning: dict[str, Any]) -> torch.Tensor:
        """The denoiser's prediction (`read_prediction` of what it returns)."""
        args, kwargs = self.denoiser_arguments(noisy, timesteps, conditioning)
        prediction = self.read_prediction(denoiser(*args, **kwargs))
        if self.unpack_prediction is not None:
            return self.unpack_prediction(prediction, noisy)
        return prediction
