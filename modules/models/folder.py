"""A diffusers folder's parts, read without loading weights: each component's config, its weight
files and their headers (`family.py: check_folder` asks the families whether the folder is of
the expected one)."""
from __future__ import annotations

import json
from pathlib import Path


# What a single checkpoint file is named (modules/models/single_file.py reads them; kept here,
# torch-free, so the input checks can tell a missing file from a missing folder).
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
SAFETENSORS_SUFFIX = ".safetensors"


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
