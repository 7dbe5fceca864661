"""The model shapes the benchmark can build locally with random weights (no download).

``tiny`` is Tempera's built-in tiny demo model. ``small`` is a ~13M-parameter UNet of the demo's
layout, big enough that compute (not Python overhead) starts to dominate on a CPU. Then each
family whose record has a `real_size` (`modules.models.families.RealSize`), under its model
type's `cli_name`: the real architecture from ``modules/models/configs/``. Random weights are
fine for timing: the kernels and shapes are what cost, not the values.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.model_types import BUILTIN_DEMO, BUILTIN_MODEL_TYPES, MODEL_TYPES, ModelType
from modules.util.atomic import publish_dir_once
from modules.models.families import FAMILIES, RealSize, family_of
from modules.models.shipped_configs import CONFIGS_DIR  # noqa: F401 - where the configs are
from modules.models.tiny import spec_fingerprint, tiny_spec
from modules.models.tiny_sd import (
    TINY_SPECS,
    TINY_VAE,
    TextEncoderSpec,
    TinySpec,
    build_from_spec,
    real_component_config,  # noqa: F401 - the real architectures' configs, for tests
)

DEMO_TYPE = BUILTIN_MODEL_TYPES[BUILTIN_DEMO]

_SMALL_TEXT = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
               "num_hidden_layers": 2, "max_position_embeddings": 77, "projection_dim": 256,
               "hidden_act": "quick_gelu"}
_SMALL_UNET = {"sample_size": 32, "in_channels": 4, "out_channels": 4,
               "block_out_channels": (64, 128, 256), "layers_per_block": 1,
               "norm_num_groups": 32, "cross_attention_dim": 256, "attention_head_dim": 8,
               "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
               "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")}


@dataclass(frozen=True)
class BenchModel:
    """One benchmark model shape: the model type and how its folder is obtained."""
    name: str
    model_type: ModelType
    description: str
    default_resolution: int
    builtin: str | None = None  # a Tempera built-in model path, used as is


def _small_spec() -> TinySpec:
    base = TINY_SPECS[DEMO_TYPE]
    return TinySpec(pipeline_class=base.pipeline_class, unet=_SMALL_UNET, vae=TINY_VAE,
                    text_encoders=(TextEncoderSpec("text_encoder", "tokenizer", "CLIPTextModel",
                                                   _SMALL_TEXT),),
                    scheduler=base.scheduler, pipeline_kwargs=base.pipeline_kwargs)


BENCH_MODELS: dict[str, BenchModel] = {
    "tiny": BenchModel("tiny", DEMO_TYPE, "Tempera's built-in tiny SD 1.5 (~0.4M UNet)",
                       64, builtin=BUILTIN_DEMO),
    "small": BenchModel("small", DEMO_TYPE, "SD-1.5-like, ~13M-parameter UNet", 256),
    **{model_type.cli_name: BenchModel(model_type.cli_name, model_type,
                                       family.real_size.description,
                                       MODEL_TYPES[model_type].default_resolution)
       for model_type, family in FAMILIES.items() if family.real_size is not None},
}


def _real_size(name: str) -> RealSize:
    model = BENCH_MODELS.get(name)
    real_size = family_of(model.model_type).real_size if model else None
    if model is None or model.builtin or name == "small" or real_size is None:
        raise ValueError(f"no real-size benchmark model {name!r}; known: "
                         f"{', '.join(BENCH_MODELS)}")
    return real_size


def bench_spec(name: str) -> TinySpec | dict[str, Any]:
    if name == "small":
        return _small_spec()
    if name not in BENCH_MODELS:
        raise ValueError(f"unknown benchmark model {name!r}; known: {', '.join(BENCH_MODELS)}")
    return _real_size(name).spec()


def unet_parameter_count(name: str) -> int:
    """Parameters of the model's denoiser (built on the meta device: no memory, no time)."""
    model = BENCH_MODELS[name]
    family = family_of(model.model_type)
    spec = tiny_spec(model.builtin) if model.builtin else bench_spec(name)
    # every benchmark model is of a family that has a real size (tiny and small: the demo's)
    assert family.real_size is not None, name
    return family.real_size.denoiser_parameters(spec)


def ensure_bench_model(name: str, cache_dir: Path) -> str:
    """The ``model.path`` for benchmark model ``name``, building its folder once into the cache."""
    model = BENCH_MODELS.get(name)
    if model is None:
        raise ValueError(f"unknown benchmark model {name!r}; known: {', '.join(BENCH_MODELS)}")
    if model.builtin:
        return model.builtin
    spec = bench_spec(name)
    target = Path(cache_dir) / "bench-models" / f"{name}-{spec_fingerprint(spec)}"
    if target.is_dir():
        return str(target)
    if name == "small":  # the demo's layout, kept in float32 as the demo's is
        small = spec
        assert isinstance(small, TinySpec)
        publish_dir_once(target, lambda tmp: build_from_spec(small, tmp, half=False))
    else:
        real_size = _real_size(name)
        publish_dir_once(target, lambda tmp: real_size.build(spec, tmp))
    return str(target)
