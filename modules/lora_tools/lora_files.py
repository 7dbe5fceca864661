"""LoRA files in either layout, read into one form and written back.

A file becomes {(component, module path): AdapterLayer}: the layer's tensors under LyCORIS's
suffixes (`lora_down.weight`, `lora_up.weight`, `hada_w1_a`, `lokr_w1`, `dora_scale`, …)
and its alpha, meaning what kohya means (the update is scaled by alpha / rank). The kohya
names are mapped with `modules.models.kohya.kohya_module_name` over the base's layers; the
diffusers/peft layout's alpha comes from its `lora_adapter_metadata` (peft's `lora_alpha`,
`alpha_pattern`, `use_rslora`), or is the rank when the file has none, as diffusers reads it.
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from modules.lora_tools.architecture import LayerKey, ModelLayout
from modules.lora_tools.errors import LoraToolError
from modules.model_types import MODEL_TYPES, ModelType
from modules.models.families import FAMILIES, FileConventions, family_files
from modules.models.kohya import fuse_lora
from modules.models.single_file import clip_key_with_text_model
from modules.util.atomic import atomic_file

KOHYA, DIFFUSERS = "kohya", "diffusers"
LAYOUTS = (KOHYA, DIFFUSERS)
DIFFUSERS_METADATA = "lora_adapter_metadata"


@dataclass
class AdapterLayer:
    """One adapted layer: its kind ("lora", "dora", "loha", "lokr"), tensors and alpha."""
    kind: str
    tensors: dict[str, torch.Tensor]
    alpha: float

    @property
    def rank(self) -> int:
        t = self.tensors
        for name in ("lora_down.weight", "hada_w1_b", "lokr_w2_b", "lokr_w1_b"):
            if name in t:
                return int(t[name].shape[0])
        return 0  # LoKr with both factors full: applied with no scale

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 1.0


def lora(down: torch.Tensor, up: torch.Tensor, alpha: float) -> AdapterLayer:
    return AdapterLayer("lora", {"lora_down.weight": down, "lora_up.weight": up}, alpha)


def delta(layer: AdapterLayer, base: torch.Tensor) -> torch.Tensor:
    """The change the layer makes to the base weight `base` (float32), per LyCORIS's
    definitions; DoRA's needs the base weight, the others only its shape."""
    t = {k: v.float() for k, v in layer.tensors.items()}
    shape = base.shape
    if layer.kind in ("lora", "dora"):
        update = (t["lora_up.weight"].flatten(1) @ t["lora_down.weight"].flatten(1))
        update = update.reshape(shape) * layer.scale
        if layer.kind == "lora":
            return update
        # DoRA: each output channel of W + ΔW scaled to the trained magnitude
        merged = base.float() + update
        norm = merged.flatten(1).norm(dim=1).reshape(-1, *[1] * (merged.dim() - 1))
        return t["dora_scale"].reshape(norm.shape) * merged / norm - base.float()
    if layer.kind == "loha":
        w1 = t["hada_w1_a"] @ t["hada_w1_b"]
        w2 = t["hada_w2_a"] @ t["hada_w2_b"]
        return (w1 * w2).reshape(shape) * layer.scale
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    return torch.kron(w1, w2).reshape(shape) * layer.scale


# --- reading ------------------------------------------------------------------------------
def read_lora(path: str | Path, layout: ModelLayout) -> tuple[str, dict[LayerKey, AdapterLayer]]:
    """A LoRA file's layout and layers, each checked against the base's layer of that name."""
    from safetensors import safe_open
    path = Path(path)
    if not path.is_file():
        raise LoraToolError(f"{path}: no such LoRA file")
    try:
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # a LoRA is small
            metadata = f.metadata() or {}
    except Exception as error:  # safetensors has its own error types for a damaged file
        raise LoraToolError(f"{path}: not a readable .safetensors file ({error})") from None
    _check_family(path, tensors, layout)
    if any(k.startswith(_kohya_prefixes(layout)) for k in tensors):
        kind, layers = KOHYA, _read_kohya(path, tensors, layout)
    elif any(".lora_A." in k for k in tensors):
        kind, layers = DIFFUSERS, _read_diffusers(path, tensors, metadata, layout)
    else:
        first = next(iter(tensors), "none")
        raise LoraToolError(f"{path}: not a LoRA in the kohya or diffusers/peft layout "
                            f"(first tensor: {first})")
    for key, layer in layers.items():
        _check_shape(path, key, layer, layout)
    return kind, layers


def _kohya_prefixes(layout: ModelLayout) -> tuple[str, ...]:
    return _prefixes(family_files(layout.model_type))


def _prefixes(files: FileConventions) -> tuple[str, ...]:
    """The kohya prefixes of a family's files: its layout's and, where that fuses layers, the
    one for adapters with no fused form (Klein's LoHa / LoKr under `lycoris_`)."""
    return (*files.kohya_prefixes.values(), *files.kohya_unfused_prefixes.values())


def _families_of(tensors: dict[str, torch.Tensor]) -> list[ModelType]:
    """The families whose LoRA files name layers as these tensors do: by the kohya prefixes
    of each family's record, or the diffusers layout's component names (its denoiser's and
    text encoders')."""
    found: set[ModelType] = set()
    for key in tensors:
        # families whose prefix the key has; of those, the ones whose layer names
        # (`lora_layer_names`) it has, if any do, else the ones that name no pattern
        prefixed = {t: f.files for t, f in FAMILIES.items() if f.files is not None
                    and _start(key, f.files) is not None}
        named = {t for t, files in prefixed.items() if files.lora_layer_names
                 and re.match(files.lora_layer_names, key[_start(key, files) or 0:])}
        found |= named or {t for t, files in prefixed.items() if not files.lora_layer_names}
    return [t for t in FAMILIES if t in found]


def _start(key: str, files: FileConventions) -> int | None:
    """Where the layer name starts in a tensor key of the family's files (after its kohya
    prefix or, in the diffusers layout, its component), None: not a key of its files."""
    components = tuple(f"{c}." for c in files.kohya_prefixes) if ".lora_A." in key else ()
    for start in (*_prefixes(files), *components):
        if key.startswith(start):
            return len(start)
    return None


def _check_family(path: Path, tensors: dict[str, torch.Tensor], layout: ModelLayout) -> None:
    """Refuse a LoRA of another family than the base's, naming both."""
    families = _families_of(tensors)
    if families and not any(_same_family(t, layout.model_type) for t in families):
        labels = " / ".join(dict.fromkeys(_kin(t) for t in families))
        raise LoraToolError(
            f"{path}: is a {labels} LoRA (its layer names), but the base {layout.source} is "
            f"{MODEL_TYPES[layout.model_type].label} ({layout.model_type.value}): a LoRA only "
            "applies to the family it was trained on")


def _kin(model_type: ModelType) -> str:
    """What a LoRA's layer names say its family is (`ModelTypeSpec.lora_kin`)."""
    spec = MODEL_TYPES[model_type]
    return spec.lora_kin or spec.label


def _same_family(a: ModelType, b: ModelType) -> bool:
    # families of one kin share the kohya prefixes; which of them the layers fit is checked
    # layer by layer (names and shapes) below
    return a == b or _kin(a) == _kin(b)


_KOHYA_SUFFIX = re.compile(r"\.(lora_down\.weight|lora_up\.weight|alpha|dora_scale|hada_\w+|"
                           r"lokr_\w+|lora_mid\.weight)$")


def _split_kohya(key: str) -> tuple[str, str]:
    """A kohya tensor's (layer name, suffix); the name may hold dots (Z-Image's files name a
    layer by its module path, `diffusion_model.layers.0.attention.to_q`)."""
    m = _KOHYA_SUFFIX.search(key)
    if m is None:
        name, _, suffix = key.partition(".")
        return name, suffix
    return key[:m.start()], m[1]


def _read_kohya(path: Path, tensors: dict[str, torch.Tensor],
                layout: ModelLayout) -> dict[LayerKey, AdapterLayer]:
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, suffix = _split_kohya(key)
        groups.setdefault(name, {})[suffix] = value
    layers = {}
    named_by: dict[LayerKey, str] = {}  # the name in the file each layer was read from
    unknown = sorted(name for name in groups
                     if name not in layout.kohya_names and name not in layout.fused_rows)
    if unknown:
        raise LoraToolError(
            f"{path}: {len(unknown)} layer(s) are not in the base ({layout.source}, "
            f"{layout.model_type.value}), e.g. {unknown[0]}: is it a LoRA for another model?")
    for name, group in groups.items():
        alpha_t = group.pop("alpha", None)
        kind = ("dora" if "dora_scale" in group else "lora" if "lora_down.weight" in group
                else "loha" if "hada_w1_a" in group else "lokr" if any(
                    k.startswith("lokr_") for k in group) else None)
        if kind is None or any(k.startswith(("hada_t", "lokr_t")) for k in group):
            raise LoraToolError(f"{path}: {name}: tensors {sorted(group)} are no adapter kind "
                                "these tools read (LoRA, LoCon, DoRA, LoHa, LoKr)")
        layer = AdapterLayer(kind, group, 0.0)
        layer.alpha = float(alpha_t) if alpha_t is not None else float(layer.rank or 1)
        found = (_split_fused(path, name, layer, layout) if name in layout.fused_rows
                 else {layout.kohya_names[name]: layer})
        for layer_key, one in found.items():
            if layer_key in named_by:  # e.g. a fused `qkv` LoRA and a `lycoris_` q layer
                raise LoraToolError(
                    f"{path}: {named_by[layer_key]} and {name} both adapt {layer_key[0]} "
                    f"{layer_key[1]}: a file holds one adapter per layer")
            named_by[layer_key] = name
            layers[layer_key] = one
    return layers


def _split_fused(path: Path, name: str, layer: AdapterLayer,
                 layout: ModelLayout) -> dict[LayerKey, AdapterLayer]:
    """A LoRA of a fused weight (Klein's `qkv`) as the LoRAs of the layers fused there, exactly:
    each takes its rows of up and the whole down (a layer whose rows are all zero is left
    out: its update is zero)."""
    if layer.kind != "lora":
        raise LoraToolError(f"{path}: {name}: a {layer.kind} layer on a fused weight: these "
                            "tools split only a LoRA into the layers fused there")
    up, rows = layer.tensors["lora_up.weight"], layout.fused_rows[name]
    if up.shape[0] != rows:
        raise LoraToolError(f"{path}: {name}: its up has {up.shape[0]} rows, but the base's "
                            f"fused weight has {rows} ({layout.source}): it was trained on "
                            "another model")
    out = {}
    for key, (start, stop) in layout.fused_parts.items():
        if layout.kohya_name(key) == name and bool(up[start:stop].any()):
            out[key] = lora(layer.tensors["lora_down.weight"].clone(), up[start:stop].clone(),
                            layer.alpha)
    return out


def _read_diffusers(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                    layout: ModelLayout) -> dict[LayerKey, AdapterLayer]:
    from peft.utils.other import get_pattern_key
    config = json.loads(metadata.get(DIFFUSERS_METADATA, "{}"))
    groups: dict[LayerKey, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        for part, suffix in ((".lora_A.", "lora_down.weight"), (".lora_B.", "lora_up.weight"),
                             (".lora_magnitude_vector", "dora_scale"), (".alpha", "alpha")):
            if part in key:
                head = key.split(part)[0]
                break
        else:
            raise LoraToolError(f"{path}: tensor {key} is not a LoRA tensor")
        component, _, module_path = head.partition(".")
        if component != layout.denoiser:
            module_path = clip_key_with_text_model(module_path)
        if (component, module_path) not in layout.shapes:
            raise LoraToolError(f"{path}: layer {head} is not in the base ({layout.source}, "
                                f"{layout.model_type.value}): is it a LoRA for another model?")
        groups.setdefault((component, module_path), {})[suffix] = value
    layers = {}
    for (component, module_path), group in groups.items():
        alpha_t = group.pop("alpha", None)
        rank = int(group["lora_down.weight"].shape[0])
        alpha = float(alpha_t) if alpha_t is not None else float(rank)
        if f"{component}.lora_alpha" in config:
            pattern = config.get(f"{component}.alpha_pattern") or {}
            match = get_pattern_key(list(pattern), module_path.removeprefix("text_model."))
            alpha = float(pattern.get(match, config[f"{component}.lora_alpha"]))
            if config.get(f"{component}.use_rslora"):
                alpha = alpha * math.sqrt(rank)  # kohya's alpha / rank = peft's alpha / sqrt(rank)
        if "dora_scale" in group:
            group["dora_scale"] = group["dora_scale"].reshape(
                -1, *[1] * (len(layout.shapes[(component, module_path)]) - 1))
        layers[(component, module_path)] = AdapterLayer(
            "dora" if "dora_scale" in group else "lora", group, alpha)
    return layers


def _check_shape(path: Path, key: LayerKey, layer: AdapterLayer, layout: ModelLayout) -> None:
    if layer.kind not in ("lora", "dora"):
        return
    shape = layout.shapes[key]
    down, up = layer.tensors["lora_down.weight"], layer.tensors["lora_up.weight"]
    if (tuple(down.shape[1:2]) != shape[1:2] or up.shape[0] != shape[0]
            or (len(shape) == 4 and tuple(down.shape[2:]) != shape[2:])):
        raise LoraToolError(
            f"{path}: {key[0]} {key[1]}: the LoRA's shapes {tuple(up.shape)} x "
            f"{tuple(down.shape)} do not fit the base's weight {shape} ({layout.source}): "
            "it was trained on another model")


# --- writing ------------------------------------------------------------------------------
def write_lora(layers: dict[LayerKey, AdapterLayer], path: Path, file_layout: str,
               layout: ModelLayout, metadata: dict[str, str] | None = None) -> Path:
    """Write LoRA / LoCon layers in `file_layout` ("kohya" or "diffusers"), atomically; the
    path must not exist."""
    from safetensors.torch import save_file
    if any(layer.kind != "lora" for layer in layers.values()):
        kinds = sorted({layer.kind for layer in layers.values()} - {"lora"})
        raise LoraToolError(f"{path}: {', '.join(kinds)} layers are not written by these tools")
    meta = {"tempera.tool": "tempera-lora", **(metadata or {})}
    if file_layout == KOHYA:
        tensors = {}
        fused: dict[str, list[tuple[tuple[int, int], dict[str, torch.Tensor]]]] = {}
        for key, layer in layers.items():
            name = layout.kohya_name(key)
            own = {"lora_down.weight": layer.tensors["lora_down.weight"].contiguous(),
                   "lora_up.weight": layer.tensors["lora_up.weight"].contiguous(),
                   "alpha": torch.tensor(float(layer.alpha), dtype=torch.float32)}
            if key in layout.fused_parts:
                fused.setdefault(name, []).append((layout.fused_parts[key], own))
                continue
            tensors.update({f"{name}.{suffix}": t for suffix, t in own.items()})
        for name, parts in fused.items():
            whole = fuse_lora(name, sorted(parts, key=lambda p: p[0][0]),
                              layout.fused_rows[name])
            tensors.update({f"{name}.{suffix}": t.contiguous() for suffix, t in whole.items()})
        ranks = Counter(layer.rank for layer in layers.values())
        meta.update({"ss_network_module": "networks.lora",
                     "ss_network_dim": str(ranks.most_common(1)[0][0] if ranks else 0)})
    else:
        tensors, meta[DIFFUSERS_METADATA] = _diffusers_tensors(layers)
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return path


def _diffusers_tensors(layers: dict[LayerKey, AdapterLayer]
                       ) -> tuple[dict[str, torch.Tensor], str]:
    """peft's layout with each layer's scale folded into lora_B, so every layer's alpha is its
    rank; layers of another rank than the component's commonest are named in rank_pattern and
    alpha_pattern (peft matches a pattern to the end of a module's path)."""
    tensors: dict[str, torch.Tensor] = {}
    config: dict[str, object] = {}
    for component in sorted({c for c, _ in layers}):
        own = {p: layer for (c, p), layer in layers.items() if c == component}
        rank = Counter(layer.rank for layer in own.values()).most_common(1)[0][0]
        other: dict[str, int] = {}
        for module_path, layer in own.items():
            stored = module_path.removeprefix("text_model.")
            head = f"{component}.{module_path}"
            tensors[f"{head}.lora_A.weight"] = layer.tensors["lora_down.weight"].contiguous()
            tensors[f"{head}.lora_B.weight"] = (layer.tensors["lora_up.weight"].float()
                                                * layer.scale).to(
                layer.tensors["lora_up.weight"].dtype).contiguous()
            if layer.rank != rank:
                other[stored] = layer.rank
        targets = sorted(p.removeprefix("text_model.") for p in own)
        config.update({f"{component}.r": rank, f"{component}.lora_alpha": float(rank),
                       f"{component}.rank_pattern": other,
                       f"{component}.alpha_pattern": {k: float(v) for k, v in other.items()},
                       f"{component}.target_modules": targets,
                       f"{component}.use_rslora": False, f"{component}.use_dora": False,
                       f"{component}.peft_type": "LORA", f"{component}.bias": "none",
                       f"{component}.init_lora_weights": True})
    return tensors, json.dumps(config, sort_keys=True)
