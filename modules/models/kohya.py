"""LoRA files in the kohya-ss layout, the one A1111, Forge and ComfyUI read.

Each adapted layer is three tensors under one name, e.g. for SD 1.x
``lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q``:
``.lora_down.weight`` (peft's lora_A), ``.lora_up.weight`` (lora_B) and ``.alpha`` (a scalar;
the update is scaled by alpha / rank). The name is the module path with dots turned into
underscores, prefixed per component (the family's `FileConventions.kohya_prefixes`).

UNet names follow what kohya's sd-scripts itself writes, since every reader is tested against
its files: SD 1.x/2.x LoRAs use the diffusers module names (sd-scripts trains SD 1/2 on a
diffusers-style UNet), SDXL LoRAs use the original ldm/sgm names (`lora_unet_input_blocks_4_1_…`;
sd-scripts trains SDXL on the sgm UNet). diffusers' `load_lora_weights` maps both
(`_maybe_map_sgm_blocks_to_diffusers`), ComfyUI's `model_lora_keys_unet` maps both, and A1111
matches ldm names directly and converts diffusers names with a regex written for SD 1.x.
Text encoder names are transformers' CLIP names (`text_model.encoder.layers.0.self_attn.q_proj`)
for every encoder, as sd-scripts writes them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from modules.config.schema import ModelType
from modules.models.families import family_of
from modules.models.metadata import MODEL_HASH_KEY, MODEL_HASH_PLACEHOLDER, stamp_model_hash
from modules.models.precision import cast_for_saving
from modules.models.single_file import clip_key_with_text_model, unet_key_to_ldm
from modules.util.atomic import atomic_file

PEFT_SUFFIXES = {".lora_A.weight": ".lora_down.weight", ".lora_B.weight": ".lora_up.weight"}


class KohyaError(ValueError):
    """LoRA weights that the kohya layout cannot express."""


def kohya_module_name(component: str, module_path: str, model_type: ModelType,
                      unet_config: Any = None) -> str:
    """The kohya name of one adapted layer, e.g. ``lora_te_text_model_encoder_layers_0_mlp_fc1``."""
    files = family_of(model_type).files
    prefixes = files.kohya_prefixes if files else {}
    if component not in prefixes:
        raise KohyaError(f"{model_type.value} has no component {component!r} in the kohya layout "
                         f"(known: {', '.join(prefixes)})")
    if component == "unet":
        # "diffusers": module paths as in diffusers' UNet2DConditionModel; "ldm": SD's own
        if files.kohya_denoiser_naming == "ldm":
            if unet_config is None:
                raise KohyaError(f"{model_type.value} LoRAs use ldm UNet names, which need the "
                                 "UNet's config (pass unet_config)")
            module_path = unet_key_to_ldm(module_path, unet_config)
    else:
        module_path = clip_key_with_text_model(module_path)
    return prefixes[component] + module_path.replace(".", "_")


def to_kohya(component_state_dicts: dict[str, dict[str, torch.Tensor]], alphas: dict[str, float],
             model_type: ModelType, unet_config: Any = None) -> dict[str, torch.Tensor]:
    """peft LoRA state dicts (per component, from `get_peft_model_state_dict`) in kohya's layout.

    `alphas` gives each component's lora_alpha; `unet_config` is needed for SDXL's ldm names.
    """
    out: dict[str, torch.Tensor] = {}
    for component, state in component_state_dicts.items():
        if component not in alphas:
            raise KohyaError(f"no LoRA alpha given for {component}")
        layers = _split_layers(component, state)
        for module_path, (down, up) in layers.items():
            name = kohya_module_name(component, module_path, model_type, unet_config)
            if name in out or f"{name}.lora_down.weight" in out:
                raise KohyaError(f"two layers map to the kohya name {name}")
            out[f"{name}.lora_down.weight"] = down
            out[f"{name}.lora_up.weight"] = up
            out[f"{name}.alpha"] = torch.tensor(float(alphas[component]), dtype=torch.float32)
    return out


def _split_layers(component: str, state: dict[str, torch.Tensor]
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path: (lora_A, lora_B)} from a peft state dict; anything else is refused."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        suffix = next((s for s in PEFT_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise KohyaError(f"{component}: {key!r} is not a plain LoRA weight (DoRA magnitudes, "
                             "LoRA biases and embedding LoRAs have no kohya LoRA equivalent)")
        parts.setdefault(key[: -len(suffix)], {})[suffix] = value
    layers = {}
    for path, pair in parts.items():
        if len(pair) != 2:
            raise KohyaError(f"{component}: {path} has only {', '.join(pair)}")
        layers[path] = (pair[".lora_A.weight"], pair[".lora_B.weight"])
    return layers


def lora_alpha(module: nn.Module, component: str) -> float:
    """The module's peft lora_alpha, refusing settings the kohya layout cannot carry."""
    config = module.peft_config["default"]
    if getattr(config, "use_rslora", False):
        raise KohyaError(f"{component}: rsLoRA scales by alpha/sqrt(rank); kohya files imply "
                         "alpha/rank, so other tools would apply the wrong strength")
    if getattr(config, "use_dora", False):
        raise KohyaError(f"{component}: DoRA adapters have no kohya LoRA equivalent")
    if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None):
        raise KohyaError(f"{component}: per-layer rank/alpha patterns are not supported here")
    return float(config.lora_alpha)


def save_kohya_lora(modules: dict[str, nn.Module], path: str | Path, alpha: float | None,
                    model_type: ModelType, metadata: dict[str, str] | None = None,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write the LoRA adapters of `modules` (by pipeline name) as one kohya .safetensors.

    `alpha` None reads each module's peft config; a given alpha must agree with it, because
    the file would otherwise not reproduce what was trained. The weights are written at
    `dtype`; each layer's alpha stays a float32 scalar, so the strength is exact in any dtype.
    Written atomically.
    """
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    states, alphas = {}, {}
    for name, module in modules.items():
        configured = lora_alpha(module, name)
        if alpha is not None and float(alpha) != configured:
            raise KohyaError(f"{name}: alpha {alpha} given, but its adapters were built with "
                             f"lora_alpha={configured}")
        alphas[name] = configured
        states[name] = cast_for_saving(get_peft_model_state_dict(module), dtype, name)
    unet_config = modules["unet"].config if "unet" in modules else None
    tensors = to_kohya(states, alphas, model_type, unet_config)
    path = Path(path)
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata=dict(metadata or {}))
        if (metadata or {}).get(MODEL_HASH_KEY) == MODEL_HASH_PLACEHOLDER:
            stamp_model_hash(tmp)
    return path
