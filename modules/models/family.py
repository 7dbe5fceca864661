"""Whether a diffusers folder is whole and of the expected family, read from its component
configs (no weights loaded); which SD version a folder holds is the SD families' own question
(`families/sd.py: detect_folder_type`, their `identify_folder`).
"""
from __future__ import annotations

from pathlib import Path

from modules.model_types import MODEL_TYPES, ModelType
from modules.models.folder import FolderError, read_config


def check_folder(folder: Path, expected: ModelType) -> None:
    """Every component folder `expected` needs is there with its config, and the folder is of
    that family; FolderError says which folder is missing or which `model.type` to set."""
    # Imported here: the families import torch, and the GUI checks a folder before torch loads.
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
