"""A diffusers folder written as one original-layout (ldm) .safetensors (or, for a family whose
single file is its denoiser alone, Z-Image's, that file), tensor by tensor, with
a merge's changes applied on the way: the key names come from the single-file saver's own
tables (`modules/models/single_file.py`: `unet_key_to_ldm`, `vae_key_to_ldm`,
`open_clip_to_ldm`), run first on meta tensors to learn every output's name and shape, then
on each real tensor (OpenCLIP's fused q/k/v: the three read together) when its turn comes.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from modules.lora_tools.architecture import ModelLayout, component_files
from modules.lora_tools.streaming import (
    SAFETENSORS_DTYPES, TORCH_DTYPES, Change, Entry, read_header)
from modules.model_types import MODEL_TYPES
from modules.models.families import family_files
from modules.models.single_file import (
    LDM_UNET_PREFIX, LDM_VAE_PREFIX, clip_key_with_text_model, open_clip_to_ldm,
    unet_key_to_ldm, vae_key_to_ldm)

Source = tuple[Path, str]  # (file, tensor key)
Convert = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
QKV = re.compile(r"(?:text_model\.)?encoder\.layers\.(\d+)\.self_attn\.[qkv]_proj\.(\w+)")


def single_file_entries(layout: ModelLayout,
                        changes: dict[Path, dict[str, Change]]) -> list[Entry]:
    """The entries `write_streamed` writes: every weight of the folder under its ldm name."""
    assert layout.path is not None
    folder, files = layout.path, family_files(layout.model_type)
    vae_config = json.loads((folder / "vae" / "config.json").read_text(encoding="utf-8"))
    num_up = len(vae_config["up_block_types"])

    def unet(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {LDM_UNET_PREFIX + unet_key_to_ldm(k, layout.unet_config): v for k, v in d.items()}

    def vae(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in d.items():
            ldm = vae_key_to_ldm(key, num_up)
            if ".mid.attn_1." in ldm and value.ndim == 2:
                value = value[:, :, None, None]  # ldm's VAE attention uses 1x1 convolutions
            out[LDM_VAE_PREFIX + ldm] = value
        return out

    groups: list[tuple[list[Source], Convert]] = []
    for component, convert in (("unet", unet), ("vae", vae)):
        groups += [([source], convert) for source in _sources(folder / component)]
    for name in MODEL_TYPES[layout.model_type].text_encoders:
        prefix, kind = files.single_file_text_encoders[name]
        sources = _sources(folder / name)
        if kind == "hf":
            groups += [([source], _hf(prefix)) for source in sources]
            continue
        fused: dict[tuple[str, str], list[Source]] = {}
        for source in sources:
            if source[1].endswith("embeddings.position_ids"):
                continue  # a buffer older transformers saved; OpenCLIP's layout has none
            if m := QKV.fullmatch(source[1]):
                fused.setdefault((m[1], m[2]), []).append(source)
            else:
                groups.append(([source], _open_clip(prefix)))
        groups += [(parts, _open_clip(prefix)) for parts in fused.values()]
    entries = [_entry(parts, convert, changes) for parts, convert in groups]
    return entries + _schedule_markers(folder)


def denoiser_file_entries(layout: ModelLayout,
                          changes: dict[Path, dict[str, Change]]) -> list[Entry]:
    """The entries of a family's lone denoiser file (Z-Image's ComfyUI diffusion model): each
    denoiser tensor of the folder under the name the family's `denoiser_file_key` gives,
    those it fuses (q, k, v) read together and stacked in their rows' order, those it stores
    rearranged (`denoiser_file_stored`) rearranged."""
    assert layout.path is not None
    files = family_files(layout.model_type)
    key_of, stored = files.denoiser_file_key, files.denoiser_file_stored
    assert key_of is not None
    groups: dict[str, list[tuple[int, Source]]] = {}
    for file in component_files(layout.path / layout.denoiser):
        header = read_header(file)[0]
        for key, info in header.items():
            if key != "__metadata__":
                name, rows = key_of(key, info["shape"][0])
                groups.setdefault(name, []).append(((rows or (0, 0))[0], (file, key)))

    def as_stored(key: str, value: torch.Tensor) -> torch.Tensor:
        rearrange = stored(key)
        return rearrange(value) if rearrange else value

    def fused(name: str, keys: list[str]) -> Convert:
        return lambda d: {name: torch.cat([d[k] for k in keys]) if len(keys) > 1
                          else as_stored(keys[0], d[keys[0]])}
    entries = []
    for name, parts in groups.items():
        ordered = [source for _, source in sorted(parts)]
        entries.append(_entry(ordered, fused(name, [k for _, k in ordered]), changes))
    return entries


def _sources(folder: Path) -> list[Source]:
    return [(file, key) for file in component_files(folder)
            for key in read_header(file)[0] if key != "__metadata__"]


def _hf(prefix: str) -> Convert:
    return lambda d: {prefix + clip_key_with_text_model(k): v for k, v in d.items()}


def _open_clip(prefix: str) -> Convert:
    return lambda d: {prefix + k: v for k, v in open_clip_to_ldm(d).items()}


def _entry(parts: list[Source], convert: Convert,
           changes: dict[Path, dict[str, Change]]) -> Entry:
    headers = {file: read_header(file)[0] for file in {file for file, _ in parts}}
    meta = {key: torch.empty(headers[file][key]["shape"], device="meta",
                             dtype=TORCH_DTYPES[headers[file][key]["dtype"]])
            for file, key in parts}
    ((name, shaped),) = convert(meta).items()

    def make() -> torch.Tensor:
        from safetensors import safe_open
        tensors = {}
        for file, key in parts:
            with safe_open(str(file), "pt") as f:
                tensor = f.get_tensor(key)
            change = changes.get(file, {}).get(key)
            tensors[key] = change(tensor).to(tensor.dtype) if change else tensor
        return next(iter(convert(tensors).values()))
    return name, SAFETENSORS_DTYPES[shaped.dtype], list(shaped.shape), make


def _schedule_markers(folder: Path) -> list[Entry]:
    """ComfyUI's empty marker tensors, as `save_single_file` writes them: `v_pred` for a
    model predicting v, `ztsnr` for a zero-terminal-SNR schedule."""
    path = folder / "scheduler" / "scheduler_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    marks = []
    if config.get("prediction_type") == "v_prediction":
        marks.append("v_pred")
    if config.get("rescale_betas_zero_snr"):
        marks.append("ztsnr")
    return [(mark, "F32", [0], lambda: torch.zeros(0)) for mark in marks]
