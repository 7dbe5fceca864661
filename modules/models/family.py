"""Whether a diffusers folder is whole and of the expected family; which SD family it holds, read from its component configs (no weights loaded).

`model_index.json` names the same pipeline class for SD 1.x and 2.x, so the family comes from
what differs between them: SDXL's UNet takes added text/time conditioning and a second text
encoder; SD 2's text encoder is OpenCLIP (exact GELU, where SD 1's CLIP uses quick GELU) and its
UNet projects attention inputs with linear layers. These hold for the real checkpoints and the
built-in tiny ones alike (widths differ, the structure does not).
"""
from __future__ import annotations

import json
from pathlib import Path

from modules.model_types import MODEL_TYPES, ModelType


class FolderError(Exception):
    """A diffusers folder that is incomplete, unreadable or of another family."""


def read_config(folder: Path, component: str) -> dict:
    """`<folder>/<component>/config.json` (scheduler: scheduler_config.json), or FolderError
    naming the missing component folder or file."""
    sub = folder / component
    if not sub.is_dir():
        raise FolderError(f"{folder}: has no {component}/ folder (a diffusers model keeps each "
                          f"component in its own folder)")
    name = "scheduler_config.json" if component == "scheduler" else "config.json"
    try:
        return json.loads((sub / name).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FolderError(f"{sub}: has no {name}") from None
    except (OSError, ValueError) as exc:
        raise FolderError(f"{sub / name}: not readable JSON ({exc})") from exc


def detect_folder_type(folder: Path) -> tuple[ModelType, str]:
    """(family, the reason in words) of a diffusers folder, from its UNet and text encoder."""
    unet = read_config(folder, "unet")
    if unet.get("addition_embed_type") == "text_time" or (folder / "text_encoder_2").is_dir():
        return ModelType.SDXL, "its UNet takes SDXL's text/time conditioning"
    text = read_config(folder, "text_encoder")
    if text.get("hidden_act") == "gelu" or unet.get("use_linear_projection"):
        return ModelType.SD2, ("its text encoder is OpenCLIP (exact GELU) and its UNet uses "
                               "linear attention projections, as SD 2.x does")
    return ModelType.SD15, "its text encoder is CLIP ViT-L (quick GELU), as SD 1.x uses"


def check_folder(folder: Path, expected: ModelType) -> None:
    """Every component folder `expected` needs is there with its config, and the folder is of
    that family; FolderError says which folder is missing or which `model.type` to set."""
    from modules.models.families import family_of
    spec = MODEL_TYPES[expected]
    for component in (*spec.components, "scheduler"):
        read_config(folder, component)
    for tokenizer in spec.tokenizers:
        if not (folder / tokenizer).is_dir():
            raise FolderError(f"{folder}: has no {tokenizer}/ folder")
    identify = family_of(expected).identify_folder
    if identify is None:  # a family with one variant: its pipeline class said enough
        return
    found, why = identify(folder)
    if found != expected:
        raise FolderError(f"{folder}: is a {MODEL_TYPES[found].label} model ({why}), but "
                          f"model.type is {expected.value}; set model.type={found.value}")


def weight_files(folder: Path, components: tuple[str, ...]) -> list[Path]:
    """The weight files of `components` (safetensors preferred, as diffusers loads them)."""
    files = []
    for component in components:
        found = sorted((folder / component).glob("*.safetensors")) or sorted(
            (folder / component).glob("*.bin"))
        files += found
    return files


def check_weight_headers(folder: Path, components: tuple[str, ...]) -> None:
    """Open each safetensors file's header: a truncated or damaged download fails here, by
    name, instead of in the middle of loading."""
    from safetensors import safe_open
    for component in components:
        files = weight_files(folder, (component,))
        if not files:
            raise FolderError(f"{folder / component}: has no weights (*.safetensors or *.bin)")
        for path in files:
            if path.suffix != ".safetensors":
                continue
            try:
                with safe_open(str(path), framework="pt") as f:
                    f.keys()
            except Exception as exc:  # safetensors raises its own error type
                raise FolderError(f"{path}: not a readable .safetensors file ({exc}); the "
                                  "download may be incomplete") from exc
