"""Adapter files in the kohya-ss / LyCORIS layout, the one A1111, Forge and ComfyUI read.

Each adapted layer is a few tensors under one name, e.g. for SD 1.x
``lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q``. LoRA / LoCon:
``.lora_down.weight`` (peft's lora_A), ``.lora_up.weight`` (lora_B) and ``.alpha`` (a scalar;
the update is scaled by alpha / rank); DoRA adds ``.dora_scale``; LoHa writes
``.hada_w1_a/_b`` and ``.hada_w2_a/_b``, LoKr ``.lokr_w1`` (or ``_a/_b``) and ``.lokr_w2`` (or
``_a/_b``), each with ``.alpha`` (LyCORIS's names; docs/adapters.md gives the maths). The name is the module path with dots turned into
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
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from modules.config.schema import ModelType
from modules.model_types import MODEL_TYPES
from modules.models.families import family_of
from modules.models.metadata import MODEL_HASH_KEY, MODEL_HASH_PLACEHOLDER, stamp_model_hash
from modules.models.precision import cast_for_saving
from modules.models.single_file import clip_key_with_text_model, unet_key_to_ldm
from modules.util.atomic import atomic_file

if TYPE_CHECKING:
    from peft import PeftConfig
    from peft.tuners.lokr.layer import LoKrLayer
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer


class KohyaError(ValueError):
    """LoRA weights that the kohya layout cannot express."""


def kohya_module_name(component: str, module_path: str, model_type: ModelType,
                      unet_config: Any = None, unfused: bool = False) -> str:
    """The kohya name of one adapted layer, e.g. ``lora_te_text_model_encoder_layers_0_mlp_fc1``;
    `unfused`: its name in the family's layout for adapters with no fused form
    (`FileConventions.kohya_unfused_prefixes`: Klein's LoHa / LoKr)."""
    files = family_of(model_type).files
    if unfused:
        return unfused_module_name(files, component, module_path, model_type)
    prefixes = files.kohya_prefixes if files else {}
    if files is None or component not in prefixes:
        raise KohyaError(f"{model_type.value} has no component {component!r} in the kohya layout "
                         f"(known: {', '.join(prefixes)})")
    if component == MODEL_TYPES[model_type].denoiser:
        # "diffusers": module paths as in diffusers' denoiser; "ldm": SD's own; "original":
        # the names of the family's lone denoiser file (Klein's BFL layout)
        if files.kohya_denoiser_naming == "original":
            name = original_layer(files, module_path, 0)[0]
            return prefixes[component] + name.replace(".", files.kohya_separator)
        if files.kohya_denoiser_naming == "ldm":
            if unet_config is None:
                raise KohyaError(f"{model_type.value} LoRAs use ldm UNet names, which need the "
                                 "UNet's config (pass unet_config)")
            module_path = unet_key_to_ldm(module_path, unet_config)
    else:
        module_path = clip_key_with_text_model(module_path)
    return prefixes[component] + module_path.replace(".", files.kohya_separator)


def unfused_module_name(files: Any, component: str, module_path: str,
                        model_type: ModelType) -> str:
    """A layer's name where its family's kohya layout fuses layers but its adapter has no fused
    form: the component's unfused prefix + the diffusers module path with "_" (how ComfyUI's
    `model_lora_keys_unet` names diffusers' Flux layers for LyCORIS files: dots as "_",
    whatever the family's `kohya_separator`)."""
    prefixes = files.kohya_unfused_prefixes if files else {}
    if component not in prefixes:
        raise KohyaError(f"{model_type.value} has no kohya layout for unfused {component} "
                         "adapters (only a LoRA's layers can be written fused)")
    return prefixes[component] + module_path.replace(".", "_")


def original_layer(files: Any, module_path: str, rows: int) -> tuple[str, tuple[int, int] | None]:
    """A denoiser layer's name in the family's lone file (no `.weight`) and, for a layer fused
    there with others (Klein's q, k, v in `qkv`), its `rows` rows of the fused weight."""
    assert files.denoiser_file_key is not None
    key, part = files.denoiser_file_key(module_path + ".weight", rows)
    return key.removesuffix(".weight"), part


def fused_rows(model_type: ModelType, component: str, rows: dict[str, int]) -> dict[str, int]:
    """{kohya name: rows of the fused weight} of the layers a family's kohya layout fuses
    (Klein's q, k, v into `qkv`), from every layer of the component ({module path: rows})."""
    files = family_of(model_type).files
    if (files is None or files.kohya_denoiser_naming != "original"
            or component != MODEL_TYPES[model_type].denoiser):
        return {}
    out: dict[str, int] = {}
    for module_path, count in rows.items():
        name, part = original_layer(files, module_path, count)
        if part is not None:
            key = files.kohya_prefixes[component] + name.replace(".", files.kohya_separator)
            out[key] = max(out.get(key, 0), part[1])
    return out


def fuse_lora(name: str, parts: list[tuple[tuple[int, int], dict[str, torch.Tensor]]],
              rows: int) -> dict[str, torch.Tensor]:
    """LoRAs of the projections a layout fuses (each (its rows, its tensors with alpha)) as one
    LoRA of the fused weight (`rows` rows), exactly: the downs stacked, each up placed at its
    rows and its ranks' columns (zeros elsewhere: a projection without a LoRA is unchanged).
    One alpha serves when every part has the same alpha / rank (the trainer's case: the update
    is then computed from the same numbers); otherwise each part's scale is folded into its up
    and the alpha is the total rank."""
    for _, tensors in parts:
        if set(tensors) != {"lora_down.weight", "lora_up.weight", "alpha"}:
            kinds = sorted(set(tensors) - {"alpha"})
            raise KohyaError(f"{name}: {', '.join(kinds)}: only LoRA layers can be fused into "
                             "the one projection this layout holds (q, k and v together); "
                             "LoHa, LoKr and DoRA have no fused form (a family may write "
                             "LoHa / LoKr unfused: FileConventions.kohya_unfused_prefixes)")
    ranks = [int(t["lora_down.weight"].shape[0]) for _, t in parts]
    scales = [float(t["alpha"]) / r for (_, t), r in zip(parts, ranks)]
    same = all(scale == scales[0] for scale in scales)
    down = torch.cat([t["lora_down.weight"] for _, t in parts], dim=0)
    first_up = parts[0][1]["lora_up.weight"]
    up = torch.zeros(rows, sum(ranks), dtype=first_up.dtype)
    column = 0
    for ((start, stop), tensors), rank, scale in zip(parts, ranks, scales):
        block = tensors["lora_up.weight"].reshape(stop - start, rank)
        up[start:stop, column:column + rank] = block if same else (block.float() * scale).to(
            block.dtype)
        column += rank
    alpha = scales[0] * sum(ranks) if same else float(sum(ranks))
    return {"lora_down.weight": down, "lora_up.weight": up,
            "alpha": torch.tensor(alpha, dtype=torch.float32)}


def writes_unfused(model_type: ModelType, component: str,
                   tensors: dict[str, dict[str, torch.Tensor]]) -> bool:
    """Whether a component's adapter tensors ({module path: `layer_tensors`}) go in the family's
    unfused layout (`FileConventions.kohya_unfused_prefixes`): some are LoHa / LoKr, which
    have no fused form. DoRA is refused there (KohyaError): its update rescales each row of
    W + dW by the base weight's norm, which a reader applying it to its rows of a fused weight
    was not checked to compute alike; in the fused layout it is refused too (`fuse_lora`)."""
    files = family_of(model_type).files
    if files is None or component not in files.kohya_unfused_prefixes:
        return False
    if all("lora_down.weight" in t for t in tensors.values()):
        return False
    dora = next((path for path, t in tensors.items() if "dora_scale" in t), None)
    if dora is not None:
        raise KohyaError(f"{component}: {dora}: DoRA has no kohya layout for "
                         f"{model_type.value}: its fused layout holds only LoRA, and DoRA "
                         "applied to the rows of a fused weight (its update depends on the "
                         "base weight's norm per row) was not verified with ComfyUI")
    return True


def to_kohya(layers: dict[str, dict[str, BaseTunerLayer]], model_type: ModelType,
             unet_config: Any = None, dtype: torch.dtype | None = torch.float32,
             fused: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """peft adapter layers ({component: {module path: layer}}) as kohya / LyCORIS tensors,
    the weights at `dtype` (None: as trained; a float16 overflow is refused) and each alpha a
    float32 scalar. `unet_config` is needed for SDXL's ldm names; `fused` ({kohya name: rows},
    `fused_rows`) names the layers the family's layout fuses (Klein's q, k, v: `fuse_lora`);
    a component with LoHa / LoKr layers is written unfused where the family has a layout for
    that (`writes_unfused`: Klein's `lycoris_` names); a fused layout without one refuses them
    (`fuse_lora`).
    """
    named: dict[str, dict[str, torch.Tensor]] = {}
    parts: dict[str, list[tuple[tuple[int, int], dict[str, torch.Tensor]]]] = {}
    for component, by_path in layers.items():
        own: dict[str, dict[str, torch.Tensor]] = {}
        for module_path, layer in by_path.items():
            try:
                own[module_path] = layer_tensors(layer)
            except KohyaError as error:
                raise KohyaError(f"{component}: {module_path}: {error}") from None
        unfused = writes_unfused(model_type, component, own)
        for module_path, tensors in own.items():
            layer = by_path[module_path]
            name = kohya_module_name(component, module_path, model_type, unet_config, unfused)
            if fused and name in fused:
                files = family_of(model_type).files
                rows = int(tensors["lora_up.weight"].shape[0]) if "lora_up.weight" in tensors \
                    else int(_weight(layer.get_base_layer()).shape[0])
                part = original_layer(files, module_path, rows)[1]
                assert part is not None
                parts.setdefault(name, []).append((part, tensors))
                continue
            if name in named:
                raise KohyaError(f"two layers map to the kohya name {name}")
            named[name] = tensors
    for name, group in parts.items():
        assert fused is not None
        named[name] = fuse_lora(name, sorted(group, key=lambda p: p[0][0]), fused[name])
    out: dict[str, torch.Tensor] = {}
    for name, tensors in named.items():
        tensors = dict(tensors)
        alpha = tensors.pop("alpha")
        weights = cast_for_saving(tensors, dtype, name)
        out.update({f"{name}.{suffix}": t for suffix, t in weights.items()})
        out[f"{name}.alpha"] = alpha
    return out


def adapter_layers(module: nn.Module) -> dict[str, BaseTunerLayer]:
    """{module path: peft adapter layer} of a component, in module order."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    return {path: layer for path, layer in module.named_modules()
            if isinstance(layer, BaseTunerLayer)}


def layer_tensors(layer: BaseTunerLayer, adapter: str = "default") -> dict[str, torch.Tensor]:
    """One peft layer's tensors under LyCORIS's suffixes, with an alpha that makes every reader
    apply the update the layer applies.

    Readers scale an update by alpha / rank (rank read from the tensors), so the saved alpha is
    peft's scaling times the rank: rsLoRA's alpha / sqrt(rank) and per-layer conv ranks and
    alphas come out right without the reader knowing of them.
    """
    from peft.tuners.loha.layer import LoHaLayer
    from peft.tuners.lokr.layer import LoKrLayer
    from peft.tuners.lora.layer import LoraLayer

    if isinstance(layer, LoraLayer):
        return _lora_tensors(layer, adapter)
    if isinstance(layer, LoHaLayer):
        if adapter in layer.hada_t1:
            raise KohyaError("LoHa's Tucker form (use_effective_conv2d) is not written")
        return {"hada_w1_a": layer.hada_w1_a[adapter], "hada_w1_b": layer.hada_w1_b[adapter],
                "hada_w2_a": layer.hada_w2_a[adapter], "hada_w2_b": layer.hada_w2_b[adapter],
                "alpha": _alpha(layer.scaling[adapter] * layer.r[adapter])}
    if isinstance(layer, LoKrLayer):
        return _lokr_tensors(layer, adapter)
    raise KohyaError(f"{type(layer).__name__} adapters have no kohya / LyCORIS layout here")


def _lora_tensors(layer: LoraLayer, adapter: str) -> dict[str, torch.Tensor]:
    """LoRA / LoCon: down (r, in[, kh, kw]), up (out, r[, 1, 1]); DoRA adds LyCORIS's
    output-axis `dora_scale` (out, 1[, 1, 1]): peft's magnitude, one per output channel."""
    if adapter not in layer.lora_A:
        raise KohyaError("not a LoRA layer with weights (embedding LoRAs are not written)")
    if getattr(layer, "lora_bias", {}).get(adapter):
        raise KohyaError("LoRA biases have no kohya equivalent")
    down, up = _weight(layer.lora_A[adapter]), _weight(layer.lora_B[adapter])
    out = {"lora_down.weight": down, "lora_up.weight": up,
           "alpha": _alpha(layer.scaling[adapter] * layer.r[adapter])}
    if layer.use_dora.get(adapter):
        magnitude = _weight(layer.lora_magnitude_vector[adapter])
        base = _weight(layer.get_base_layer())
        out["dora_scale"] = magnitude.reshape(base.shape[0], *[1] * (base.dim() - 1))
    return out


def _lokr_tensors(layer: LoKrLayer, adapter: str) -> dict[str, torch.Tensor]:
    """LoKr: w1 (or w1_a @ w1_b) kron w2 (or w2_a @ w2_b).

    Readers take the rank from w2_b (else w1_b) and scale by alpha / rank; with both factors
    full they apply no scale at all (LyCORIS ignores alpha then), so peft's alpha / r is folded
    into w1 and the alpha written is the rank, as LyCORIS writes it.
    """
    if adapter in layer.lokr_t2:
        raise KohyaError("LoKr's Tucker form (use_effective_conv2d) is not written")
    scale, rank = float(layer.scaling[adapter]), layer.r[adapter]
    out: dict[str, torch.Tensor] = {}
    full = adapter in layer.lokr_w1 and adapter in layer.lokr_w2
    for factor in ("w1", "w2"):
        if adapter in getattr(layer, f"lokr_{factor}"):
            weight = getattr(layer, f"lokr_{factor}")[adapter]
            out[f"lokr_{factor}"] = weight * scale if full and factor == "w1" else weight
        else:
            out[f"lokr_{factor}_a"] = getattr(layer, f"lokr_{factor}_a")[adapter]
            out[f"lokr_{factor}_b"] = getattr(layer, f"lokr_{factor}_b")[adapter]
    out["alpha"] = _alpha(rank if full else scale * rank)
    return out


def _plain_linears(module: nn.Module) -> dict[str, nn.Module]:
    """{module path: the Linear layer} of a module, a LoRA-wrapped layer by its own path (its
    base layer's weight), peft's own Linear layers (lora_A, lora_B) left out."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    out: dict[str, nn.Module] = {}
    for path, layer in module.named_modules():
        if isinstance(layer, BaseTunerLayer):
            out[path] = layer.get_base_layer()
        elif (isinstance(layer, nn.Linear) and ".lora_" not in path
              and not path.endswith(".base_layer")):
            out[path] = layer
    return out


def _weight(layer: nn.Module) -> torch.Tensor:
    """`layer.weight`, checked to be a tensor (nn.Module's attributes are Tensor | Module)."""
    weight = layer.weight
    if not isinstance(weight, torch.Tensor):
        raise KohyaError(f"{type(layer).__name__}.weight is not a tensor")
    return weight


def _alpha(value: float) -> torch.Tensor:
    return torch.tensor(float(value), dtype=torch.float32)


def adapter_config(module: nn.Module, adapter: str = "default") -> PeftConfig:
    """The peft config of the adapter that diffusers' or transformers' `add_adapter` injected
    into `module` (they keep one per adapter name in `module.peft_config`)."""
    configs: dict[str, PeftConfig] = getattr(module, "peft_config")  # not an nn.Module attribute
    return configs[adapter]


def lora_alpha(module: nn.Module, component: str) -> float:
    """The alpha of the module's adapters (peft's lora_alpha, or alpha for LoHa / LoKr)."""
    config = adapter_config(module)
    return float(getattr(config, "lora_alpha", getattr(config, "alpha", 0.0)))


def save_kohya_lora(modules: dict[str, nn.Module], path: str | Path, alpha: float | None,
                    model_type: ModelType, metadata: dict[str, str] | None = None,
                    dtype: torch.dtype = torch.float32) -> Path:
    """Write the adapters of `modules` (by pipeline name) as one kohya / LyCORIS .safetensors.

    `alpha` None takes each module's own; a given alpha must agree with the module's config,
    because the file would otherwise not reproduce what was trained. The weights are written
    at `dtype`; each layer's alpha stays a float32 scalar, so the strength is exact in any
    dtype. Written atomically.
    """
    from safetensors.torch import save_file

    layers = {}
    for name, module in modules.items():
        configured = lora_alpha(module, name)
        if alpha is not None and float(alpha) != configured:
            raise KohyaError(f"{name}: alpha {alpha} given, but its adapters were built with "
                             f"lora_alpha={configured}")
        layers[name] = adapter_layers(module)
    unet_config = modules["unet"].config if "unet" in modules else None
    fused: dict[str, int] = {}
    for name, module in modules.items():
        rows = {path: int(_weight(m).shape[0]) for path, m in _plain_linears(module).items()}
        fused.update(fused_rows(model_type, name, rows))
    tensors = to_kohya(layers, model_type, unet_config, dtype, fused)
    path = Path(path)
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata=dict(metadata or {}))
        if (metadata or {}).get(MODEL_HASH_KEY) == MODEL_HASH_PLACEHOLDER:
            stamp_model_hash(tmp)
    return path
