"""The bottom of the engine: which model types exist, what each has, and the `builtin:` names.

Config, data, models, compile and the GUI all import from here; this module imports nothing of
Tempera's, so the layers above it only ever point down. Validation, the loader, the compile
engine and the GUI read `MODEL_TYPES` rather than hard-coding component names.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

BUILTIN_PREFIX = "builtin:"
BUILTIN_TINY_SD15 = "builtin:tiny-sd15"
BUILTIN_SHAPES = "builtin:shapes"
BUILTIN_DATASETS = (BUILTIN_SHAPES,)


class ModelType(str, Enum):
    SD15 = "SD15"
    SD2 = "SD2"
    SDXL = "SDXL"
    ZIMAGE = "ZIMAGE"
    KLEIN = "KLEIN"


@dataclass(frozen=True)
class ModelTypeSpec:
    label: str
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


MODEL_TYPES: dict[ModelType, ModelTypeSpec] = {
    ModelType.SD15: ModelTypeSpec("Stable Diffusion 1.x", "StableDiffusionPipeline",
                                  ("text_encoder",), ("tokenizer",), 512, "builtin:tiny-sd15"),
    ModelType.SD2: ModelTypeSpec("Stable Diffusion 2.x", "StableDiffusionPipeline",
                                 ("text_encoder",), ("tokenizer",), 768, "builtin:tiny-sd2"),
    ModelType.SDXL: ModelTypeSpec("Stable Diffusion XL", "StableDiffusionXLPipeline",
                                  ("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"),
                                  1024, "builtin:tiny-sdxl"),
    ModelType.ZIMAGE: ModelTypeSpec("Z-Image", "ZImagePipeline", ("text_encoder",),
                                    ("tokenizer",), 1024, "builtin:tiny-zimage",
                                    denoiser="transformer", denoiser_label="Transformer",
                                    flow_matching=True, samplers=("EULER",),
                                    own_settings=("model.text_encoder_path", "model.vae_path",
                                                  "model.train_distilled")),
    # Flux.2 Klein, base 4B (Qwen3-4B) and 9B (Qwen3-8B): one type, the folder's configs say
    # which; the step-distilled Klein models are refused unless model.train_distilled says so
    ModelType.KLEIN: ModelTypeSpec("Flux.2 Klein", "Flux2KleinPipeline", ("text_encoder",),
                                   ("tokenizer",), 1024, "builtin:tiny-klein",
                                   denoiser="transformer", denoiser_label="Transformer",
                                   flow_matching=True, samplers=("EULER",),
                                   own_settings=("model.train_distilled",)),
}
