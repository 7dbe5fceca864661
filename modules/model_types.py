"""The bottom of the engine: which model types exist, what each has, and the `builtin:` names.

Config, data, models, compile and the GUI all import from here; this module imports nothing of
Tempera's, so the layers above it only ever point down. Validation, the loader, the compile
engine and the GUI read `MODEL_TYPES` rather than hard-coding component names.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

BUILTIN_PREFIX = "builtin:"
BUILTIN_DEMO = "builtin:tiny-sd15"  # the demo's model and the config's default
BUILTIN_SHAPES = "builtin:shapes"
BUILTIN_DATASETS = (BUILTIN_SHAPES,)


class ModelType(str, Enum):
    SD15 = "SD15"
    SD2 = "SD2"
    SDXL = "SDXL"
    ZIMAGE = "ZIMAGE"
    KLEIN = "KLEIN"

    @property
    def cli_name(self) -> str:
        """How command lines and menus that take a family name it ("sdxl"); `ModelType(name.upper())`
        reads it back."""
        return self.value.lower()


@dataclass(frozen=True)
class ModelTypeSpec:
    label: str
    short_label: str              # where space is short (the LoRA tools' model-type menu)
    pipeline_class: str           # diffusers pipeline class name
    text_encoders: tuple[str, ...]  # attribute names on the pipeline, in order
    tokenizers: tuple[str, ...]
    default_resolution: int
    builtin: str                  # the tiny locally built variant
    denoiser: str = "unet"        # the denoiser's component name (bundle and pipeline)
    denoiser_label: str = "UNet"  # what people call it
    # trained with flow matching (the family's objective is families/flow.py's), not DDPM: the
    # config layer reads it to offer and refuse the options of each (tests check it agrees)
    flow_matching: bool = False
    # the sampling.sampler values its pipeline can sample with (None: every one)
    samplers: tuple[str, ...] | None = None
    # the settings only this type reads (Z-Image's ComfyUI files, its distillation guard):
    # greyed, with why, while another type is chosen (modules/config/field_rules.py)
    own_settings: tuple[str, ...] = ()
    # what a LoRA's layer names say its family is, where several families' names look alike
    # (kohya names SD 1.x, 2.x and XL layers with the same prefixes): families sharing it are
    # told apart layer by layer (modules/lora_tools/lora_files.py); None: the label
    lora_kin: str | None = None
    # adapters beyond those with a diffusers layout everywhere (modules/config/adapters.py)
    # whose diffusers-layout file this type's pipeline loads (`load_lora_weights`), by name
    diffusers_adapters: tuple[str, ...] = ()
    # the tools that read this type's KOHYA adapter files (named where a format is refused)
    kohya_readers: str = "ComfyUI, A1111 / Forge and LyCORIS"

    @property
    def components(self) -> tuple[str, ...]:
        """Every trainable/compilable component this type has."""
        return (self.denoiser, *self.text_encoders, "vae")

    def config_key(self, component: str) -> str:
        """The field of `components.*` that configures `component`: the denoiser's is
        "denoiser" whatever the family calls it."""
        return "denoiser" if component == self.denoiser else component

    @property
    def config_keys(self) -> tuple[str, ...]:
        """The `components.*` fields this type has."""
        return tuple(self.config_key(name) for name in self.components)


_SD_LORA_KIN = "Stable Diffusion (1.x, 2.x or XL)"
# what loading an SD checkpoint file reads beside it (its tokenizer, its configs) and lets it be
# (a pickle); Z-Image's and Klein's files read the first two
_SINGLE_FILE_SETTINGS = ("model.tokenizer_path", "model.config_path")
# channels-last memory layout speeds a UNet's convolutions; a transformer's linear layers have
# no such layout (its input is packed into tokens), so it does nothing there
_SD_OWN = (*_SINGLE_FILE_SETTINGS, "model.allow_pickle", "training.channels_last")
MODEL_TYPES: dict[ModelType, ModelTypeSpec] = {
    ModelType.SD15: ModelTypeSpec("Stable Diffusion 1.x", "SD 1.x", "StableDiffusionPipeline",
                                  ("text_encoder",), ("tokenizer",), 512, "builtin:tiny-sd15",
                                  own_settings=_SD_OWN, lora_kin=_SD_LORA_KIN),
    ModelType.SD2: ModelTypeSpec("Stable Diffusion 2.x", "SD 2.x", "StableDiffusionPipeline",
                                 ("text_encoder",), ("tokenizer",), 768, "builtin:tiny-sd2",
                                 own_settings=_SD_OWN, lora_kin=_SD_LORA_KIN),
    ModelType.SDXL: ModelTypeSpec("Stable Diffusion XL", "SDXL", "StableDiffusionXLPipeline",
                                  ("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"),
                                  1024, "builtin:tiny-sdxl", own_settings=_SD_OWN,
                                  lora_kin=_SD_LORA_KIN),
    ModelType.ZIMAGE: ModelTypeSpec("Z-Image", "Z-Image", "ZImagePipeline", ("text_encoder",),
                                    ("tokenizer",), 1024, "builtin:tiny-zimage",
                                    denoiser="transformer", denoiser_label="Transformer",
                                    flow_matching=True, samplers=("EULER",),
                                    own_settings=(*_SINGLE_FILE_SETTINGS,
                                                  "model.text_encoder_path", "model.vae_path",
                                                  "model.train_distilled"),
                                    kohya_readers="ComfyUI"),
    # Flux.2 Klein, base 4B (Qwen3-4B) and 9B (Qwen3-8B): one type, the folder's configs say
    # which; the step-distilled Klein models are refused unless model.train_distilled says so
    ModelType.KLEIN: ModelTypeSpec("Flux.2 Klein", "Klein", "Flux2KleinPipeline",
                                   ("text_encoder",), ("tokenizer",), 1024, "builtin:tiny-klein",
                                   denoiser="transformer", denoiser_label="Transformer",
                                   flow_matching=True, samplers=("EULER",),
                                   own_settings=(*_SINGLE_FILE_SETTINGS,
                                                 "model.text_encoder_path", "model.vae_path",
                                                 "model.train_distilled"),
                                   # Flux2KleinPipeline.load_lora_weights reads peft's LoKr
                                   # file (diffusers 0.42.1's Flux2LoraLoaderMixin)
                                   diffusers_adapters=("LOKR",), kohya_readers="ComfyUI"),
}
# builtin: name -> its model type
BUILTIN_MODEL_TYPES: dict[str, ModelType] = {spec.builtin: t for t, spec in MODEL_TYPES.items()}
