"""The model shapes the benchmark can build locally with random weights (no download).

``tiny`` is Tempera's built-in tiny SD 1.5. ``small`` is a ~13M-parameter SD-1.5-like UNet,
big enough that compute (not Python overhead) starts to dominate on a CPU. ``sd15`` and ``sdxl``
are the real architectures: read from ``modules/models/configs/`` when that folder is present,
else from the small table below (the same public diffusers values). Random weights are fine for
timing: the kernels and shapes are what cost, not the values.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.model_types import BUILTIN_PREFIX, ModelType
from modules.util.atomic import publish_dir_once
from modules.models.tiny import (
    TINY_VAE,
    TINY_SPECS,
    TextEncoderSpec,
    TinySpec,
    build_tiny_components,
    save_tiny_pipeline,
    spec_fingerprint,
)

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "models" / "configs"

# Keys of a shipped CLIP config that the builder fills in itself (from the locally trained
# tokenizer) or that are metadata, not architecture.
_TEXT_CONFIG_DROP = {"architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
                     "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"}

_CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
           "num_hidden_layers": 12, "max_position_embeddings": 77, "projection_dim": 768,
           "hidden_act": "quick_gelu"}
_OPEN_CLIP_BIG_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 20,
                    "num_hidden_layers": 32, "max_position_embeddings": 77,
                    "projection_dim": 1280, "hidden_act": "gelu"}
_SD_VAE = {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2,
           "block_out_channels": [128, 256, 512, 512], "norm_num_groups": 32,
           "down_block_types": ["DownEncoderBlock2D"] * 4,
           "up_block_types": ["UpDecoderBlock2D"] * 4, "sample_size": 512,
           "scaling_factor": 0.18215}

# Used only when modules/models/configs/ is absent: the real UNet/VAE/CLIP architectures.
FALLBACK_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "sd15": {
        "unet": {"sample_size": 64, "in_channels": 4, "out_channels": 4,
                 "block_out_channels": [320, 640, 1280, 1280], "layers_per_block": 2,
                 "cross_attention_dim": 768, "attention_head_dim": 8,
                 "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                 "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3},
        "vae": _SD_VAE,
        "text_encoder": _CLIP_L,
    },
    "sdxl": {
        "unet": {"sample_size": 128, "in_channels": 4, "out_channels": 4,
                 "block_out_channels": [320, 640, 1280], "layers_per_block": 2,
                 "transformer_layers_per_block": [1, 2, 10], "cross_attention_dim": 2048,
                 "attention_head_dim": [5, 10, 20], "use_linear_projection": True,
                 "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
                 "projection_class_embeddings_input_dim": 2816,
                 "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D",
                                      "CrossAttnDownBlock2D"],
                 "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]},
        "vae": {**_SD_VAE, "sample_size": 1024, "scaling_factor": 0.13025},
        "text_encoder": _CLIP_L,
        "text_encoder_2": _OPEN_CLIP_BIG_G,
    },
}

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


def _shipped_config(family: str, component: str) -> dict[str, Any] | None:
    path = CONFIGS_DIR / family / component / "config.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not k.startswith("_")}


def real_component_config(family: str, component: str) -> tuple[dict[str, Any], str]:
    """(config, source) of a real architecture: the shipped config if present, else the table."""
    shipped = _shipped_config(family, component)
    if shipped is not None:
        if component.startswith("text_encoder"):
            shipped = {k: v for k, v in shipped.items() if k not in _TEXT_CONFIG_DROP}
        return shipped, f"modules/models/configs/{family}/{component}/config.json"
    return dict(FALLBACK_CONFIGS[family][component]), "modules/bench/models.py table"


def _real_spec(family: str, model_type: ModelType) -> TinySpec:
    base = TINY_SPECS[model_type]
    text_encoders = tuple(
        TextEncoderSpec(te.name, te.tokenizer, te.model_class,
                        real_component_config(family, te.name)[0])
        for te in base.text_encoders)
    return TinySpec(pipeline_class=base.pipeline_class,
                    unet=real_component_config(family, "unet")[0],
                    vae=real_component_config(family, "vae")[0],
                    text_encoders=text_encoders, scheduler=base.scheduler,
                    pipeline_kwargs=base.pipeline_kwargs)


def _small_spec() -> TinySpec:
    base = TINY_SPECS[ModelType.SD15]
    return TinySpec(pipeline_class=base.pipeline_class, unet=_SMALL_UNET, vae=TINY_VAE,
                    text_encoders=(TextEncoderSpec("text_encoder", "tokenizer", "CLIPTextModel",
                                                   _SMALL_TEXT),),
                    scheduler=base.scheduler, pipeline_kwargs=base.pipeline_kwargs)


def zimage_spec() -> dict[str, Any]:
    """Z-Image at its real size from the shipped configs, in the layout of the tiny one
    (modules/models/tiny_zimage.py): the 6 B transformer, Qwen3-4B, Flux's VAE. The tokenizer
    is trained here as for the tiny model (600 tokens, not Qwen's 151,936: the embedding table
    is 0.7 GiB smaller in bf16; the encoder leaves the GPU once the captions are cached)."""
    from modules.models.tiny_zimage import TINY_ZIMAGE
    spec = {part: real_component_config("zimage", part)[0]
            for part in ("transformer", "text_encoder", "vae")}
    spec["scheduler"] = _shipped_scheduler("zimage")
    return {**spec, "tokenizer_vocab_size": TINY_ZIMAGE["tokenizer_vocab_size"]}


def _shipped_scheduler(family: str) -> dict[str, Any]:
    path = CONFIGS_DIR / family / "scheduler" / "scheduler_config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not k.startswith("_")}


BENCH_MODELS: dict[str, BenchModel] = {
    "tiny": BenchModel("tiny", ModelType.SD15, "Tempera's built-in tiny SD 1.5 (~0.4M UNet)",
                       64, builtin=f"{BUILTIN_PREFIX}tiny-sd15"),
    "small": BenchModel("small", ModelType.SD15, "SD-1.5-like, ~13M-parameter UNet", 256),
    "sd15": BenchModel("sd15", ModelType.SD15, "SD 1.5 architecture, random weights", 512),
    "sdxl": BenchModel("sdxl", ModelType.SDXL, "SDXL base architecture, random weights", 1024),
    "zimage": BenchModel("zimage", ModelType.ZIMAGE, "Z-Image architecture (6 B transformer, "
                         "Qwen3-4B), random weights", 1024),
}

# name -> function building its spec (explicit table, no registration at import).
_SPEC_BUILDERS = {
    "small": _small_spec,
    "sd15": lambda: _real_spec("sd15", ModelType.SD15),
    "sdxl": lambda: _real_spec("sdxl", ModelType.SDXL),
}
# Big models are saved in fp16 to halve the folder (they are loaded in the run's weight dtype).
_SAVE_HALF = {"sd15", "sdxl"}


def bench_spec(name: str) -> TinySpec | dict[str, Any]:
    if name == "zimage":
        return zimage_spec()
    if name not in _SPEC_BUILDERS:
        raise ValueError(f"unknown benchmark model {name!r}; known: {', '.join(BENCH_MODELS)}")
    return _SPEC_BUILDERS[name]()


def unet_parameter_count(name: str) -> int:
    """Parameters of the model's UNet (builds it on the meta device: no memory, no time)."""
    import diffusers
    import torch

    if name == "zimage":
        with torch.device("meta"):
            unet = diffusers.ZImageTransformer2DModel(**zimage_spec()["transformer"])
        return sum(p.numel() for p in unet.parameters())
    spec = TINY_SPECS[ModelType.SD15] if name == "tiny" else bench_spec(name)
    assert isinstance(spec, TinySpec)
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(**spec.unet)
    return sum(p.numel() for p in unet.parameters())


def _build_folder(spec: TinySpec, dest: Path, half: bool) -> Path:
    import torch

    with tempfile.TemporaryDirectory(prefix="tempera-bench-tokenizer-") as work_dir:
        components = build_tiny_components(spec, Path(work_dir))
        if half:
            for value in components.values():
                if isinstance(value, torch.nn.Module):
                    value.to(torch.float16)
        save_tiny_pipeline(spec, components, Path(work_dir), dest)
    return dest


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
    if isinstance(spec, dict):  # Z-Image: its own builder, saved in bf16 as it is released
        import torch

        from modules.models.tiny_zimage import build_tiny_zimage
        zimage = spec
        publish_dir_once(target, lambda tmp: build_tiny_zimage(tmp, spec=zimage,
                                                               dtype=torch.bfloat16))
    else:
        tiny = spec
        publish_dir_once(target, lambda tmp: _build_folder(tiny, tmp, name in _SAVE_HALF))
    return str(target)
