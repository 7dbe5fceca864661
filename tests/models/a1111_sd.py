"""Full-size SD 1.5 / 2.x / SDXL on the meta device, on both sides of A1111's LoRA loader.

A1111 converts diffusers LoRA names to its ldm names with arithmetic written for the full-size
block layout (input block = 1 + 3·level + layer), and matches them against the layers of the
model it has loaded; the tiny models' names cannot resolve. So both sides are built at full
size, weightless (`torch.device("meta")`):

- Tempera's side (`tempera_lora_file`): the diffusers UNet and text encoders from the shipped
  real configs (modules/models/configs/), the trainer's own `add_adapter` on them, then only the
  adapter tensors made real (small seeded random values) and the file written by Tempera's
  writer (`save_kohya_lora`, with the trainer's metadata): the names are what users get.
- The webui's side (`webui_model`): what A1111's `assign_network_names_to_compvis_modules`
  walks. `model.diffusion_model` is ldm's `UNetModel` (SD 1/2) or sgm's (SDXL) built from the
  yaml A1111 loads; the text encoders are laid out as ldm's / sgm's embedders hold them:
  `FrozenCLIPEmbedder.transformer` (a transformers CLIPTextModel of openai/clip-vit-large-
  patch14's shape) and `FrozenOpenCLIPEmbedder(2).model` (open_clip's CLIP, `visual` deleted),
  behind A1111's `.wrapped` hijack wrappers (`cond_stage_model.wrapped`, SDXL's
  `conditioner.embedders[i].wrapped`). The embedders' own `__init__`s download their weights,
  so the stand-ins set the same attributes. A1111 v1.10 pins transformers 4.30, whose
  CLIPTextModel keeps its layers under `text_model.`; the installed transformers flattened
  that (5.6), so the CLIP-L model is nested under `text_model`, giving the 4.30 names.
"""
from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modules.bench.models import real_component_config
from modules.config.schema import Adapter, Config
from modules.model_types import MODEL_TYPES, ModelType
from tests.models.a1111_harness import CONFIGS

FAMILY = {ModelType.SD15: "sd15", ModelType.SD2: "sd2", ModelType.SDXL: "sdxl"}
# the text config of openai/clip-vit-large-patch14, which ldm's and sgm's FrozenCLIPEmbedder load
CLIP_VIT_L_14 = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
                 "num_hidden_layers": 12, "max_position_embeddings": 77, "projection_dim": 768,
                 "hidden_act": "quick_gelu"}
# the open_clip architecture of SD 2's FrozenOpenCLIPEmbedder and SDXL's FrozenOpenCLIPEmbedder2
OPEN_CLIP_ARCH = {"sd2": "ViT-H-14", "sdxl": "ViT-bigG-14"}
RANK, ALPHA, CONV_RANK, CONV_ALPHA = 4, 2.0, 2, 1.0
ADAPTER_TAGS = ("lora_A", "lora_B", "lora_magnitude_vector", "hada_", "lokr_")


def _yaml_unet_params(a1111: Any, family: str) -> dict[str, Any]:
    import yaml
    config = yaml.safe_load((a1111.root / CONFIGS[family]).read_text(encoding="utf-8"))
    params = config["model"]["params"]
    return dict(params["network_config" if family == "sdxl" else "unet_config"]["params"])


def _clip_l_embedder() -> nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel
    embedder, transformer = nn.Module(), nn.Module()
    transformer.text_model = CLIPTextModel(CLIPTextConfig(**CLIP_VIT_L_14))
    embedder.transformer = transformer
    return embedder


def _open_clip_embedder(a1111: Any, arch: str) -> nn.Module:
    model = a1111.open_clip.create_model(arch, pretrained=None, device="meta")
    del model.visual  # as the embedders' __init__ do
    embedder = nn.Module()
    embedder.model = model
    return embedder


def webui_model(a1111: Any, model_type: ModelType) -> types.SimpleNamespace:
    """The loaded-model object A1111's LoRA loader walks (`shared.sd_model`), weightless."""
    family = FAMILY[model_type]
    params = _yaml_unet_params(a1111, family)
    sdxl = family == "sdxl"
    with torch.device("meta"):
        wrapper = nn.Module()
        wrapper.diffusion_model = (a1111.sgm if sdxl else a1111.ldm).UNetModel(**params)
        if sdxl:
            embedders = [types.SimpleNamespace(wrapped=_clip_l_embedder()),
                         types.SimpleNamespace(wrapped=_open_clip_embedder(a1111, "ViT-bigG-14"))]
            return types.SimpleNamespace(is_sdxl=True, is_sd2=False, model=wrapper,
                                         conditioner=types.SimpleNamespace(embedders=embedders))
        encoder = (_open_clip_embedder(a1111, OPEN_CLIP_ARCH[family]) if family == "sd2"
                   else _clip_l_embedder())
        return types.SimpleNamespace(is_sdxl=False, is_sd2=family == "sd2", model=wrapper,
                                     cond_stage_model=types.SimpleNamespace(wrapped=encoder))


def training_config(model_type: ModelType, adapter: Adapter) -> Config:
    """A LoRA run's config for `model_type` training the UNet and every text encoder."""
    from modules.config.overrides import apply_overrides
    spec = MODEL_TYPES[model_type]
    trains = [f"components.{spec.config_key(n)}.train=true" for n in spec.components
              if n in spec.text_encoders or n == spec.denoiser]
    return apply_overrides(Config(), [
        f"model.type={model_type.value}", f"training.adapter={adapter.value}",
        f"training.lora_rank={RANK}", f"training.lora_alpha={ALPHA}",
        f"training.conv_rank={CONV_RANK}", f"training.conv_alpha={CONV_ALPHA}", *trains])


def _tempera_components(model_type: ModelType) -> dict[str, nn.Module]:
    """Tempera's full-size diffusers UNet and transformers text encoders, weightless."""
    import diffusers
    import transformers
    from modules.models.tiny_sd import TINY_SPECS
    family = FAMILY[model_type]
    with torch.device("meta"):
        out: dict[str, nn.Module] = {
            "unet": diffusers.UNet2DConditionModel.from_config(
                real_component_config(family, "unet")[0])}
        for te in TINY_SPECS[model_type].text_encoders:
            cls = getattr(transformers, te.model_class)
            out[te.name] = cls(transformers.CLIPTextConfig(**real_component_config(family,
                                                                                   te.name)[0]))
    return out


def materialize_adapters(module: nn.Module, generator: torch.Generator) -> None:
    """Give the adapter parameters of a meta-device module real, small random values (the
    base weights stay weightless); DoRA magnitudes get positive values near a weight norm."""
    for name, param in list(module.named_parameters()):
        if not param.is_meta or not any(tag in name for tag in ADAPTER_TAGS):
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        value = torch.randn(param.shape, generator=generator) * 0.05
        if "lora_magnitude_vector" in name:
            value = 1.0 + value.abs()
        setattr(owner, attr, nn.Parameter(value, requires_grad=False))


def tempera_lora_file(model_type: ModelType, adapter: Adapter, dest: Path,
                      seed: int = 0) -> tuple[Path, dict[str, nn.Module]]:
    """(path, components) of the kohya file Tempera writes for a full-size `model_type` run
    with `adapter` on the UNet and the text encoders (the trainer's `add_adapter`, the writer
    `save_kohya_lora` with the trainer's metadata)."""
    from modules.config.secret_settings import shared_config
    from modules.models.families import family_of
    from modules.models.kohya import save_kohya_lora
    from modules.models.metadata import training_metadata
    from modules.train.recipe.adapters import add_adapter

    config = training_config(model_type, adapter)
    components = _tempera_components(model_type)
    generator = torch.Generator().manual_seed(seed)
    for name, module in components.items():
        denoiser = name == "unet"
        add_adapter(module, config, denoiser=denoiser,
                    scope=family_of(model_type).lora_scope if denoiser else None)
        materialize_adapters(module, generator)
    meta = training_metadata(shared_config(config), model_type, config.training.method, "lora",
                             layout="kohya", steps=1)
    path = save_kohya_lora(components, dest, config.training.lora_alpha, model_type, meta)
    return path, components


def expected_update(tensors: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The weight change one kohya / LyCORIS layer's tensors describe, at the webui layer's
    `shape`, computed here from the maths (docs/adapters.md), not by A1111's code: LoRA
    up·down·alpha/rank, LoHa (w1a·w1b)⊙(w2a·w2b)·alpha/rank, LoKr w1⊗w2 (·alpha/rank when a
    factor is low-rank)."""
    def flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], -1).double()

    alpha = float(tensors["alpha"])
    if "lora_down.weight" in tensors:
        down = tensors["lora_down.weight"]
        update = flat(tensors["lora_up.weight"]) @ flat(down) * (alpha / down.shape[0])
    elif "hada_w1_a" in tensors:
        rank = tensors["hada_w1_b"].shape[0]
        update = (flat(tensors["hada_w1_a"]) @ flat(tensors["hada_w1_b"])) * (
            flat(tensors["hada_w2_a"]) @ flat(tensors["hada_w2_b"])) * (alpha / rank)
    else:
        factors, rank = [], None
        for f in ("w1", "w2"):
            if f"lokr_{f}" in tensors:
                factors.append(tensors[f"lokr_{f}"].double())
            else:
                a, b = tensors[f"lokr_{f}_a"].double(), tensors[f"lokr_{f}_b"].double()
                factors.append((a @ b.reshape(b.shape[0], -1)).reshape(a.shape[0],
                                                                       *b.shape[1:]))
                rank = b.shape[0]
        w1, w2 = factors
        # Kronecker product by its definition: block (i, j) is w1[i, j] · w2
        kron = torch.einsum("ij,kl...->ikjl...", w1, w2)
        update = kron.reshape(w1.shape[0] * w2.shape[0], w1.shape[1] * w2.shape[1],
                              *w2.shape[2:])
        update = update * (alpha / rank if rank else 1.0)
    return update.reshape(shape)
