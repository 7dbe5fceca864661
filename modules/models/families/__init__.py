"""The model families, by model type: an explicit table, no registration at import time.

`family_of(model_type)` is how the trainer, the loaders and the compile guard learn what a
family does differently (`base.ModelFamily`).
"""
from __future__ import annotations

from modules.model_types import ModelType
from modules.models.families.base import (FileConventions, ModelFamily, Objective, RealSize,
                                          TextEmbeddings)
from modules.models.families.klein import KLEIN
from modules.models.families.sd import sd_family
from modules.models.families.sdxl import SDXL
from modules.models.families.zimage import ZIMAGE

FAMILIES: dict[ModelType, ModelFamily] = {
    ModelType.SD15: sd_family(ModelType.SD15),
    ModelType.SD2: sd_family(ModelType.SD2),
    ModelType.SDXL: SDXL,
    ModelType.ZIMAGE: ZIMAGE,
    ModelType.KLEIN: KLEIN,
}


def family_of(model_type: ModelType) -> ModelFamily:
    return FAMILIES[model_type]


def family_files(model_type: ModelType) -> FileConventions:
    """How other tools name a family's files; ValueError for a family that has no such files."""
    files = family_of(model_type).files
    if files is None:
        raise ValueError(f"{model_type.value} has no file layout other tools read (kohya, "
                         "single file)")
    return files


__all__ = ["FAMILIES", "FileConventions", "ModelFamily", "Objective", "RealSize", "TextEmbeddings",
           "family_files", "family_of"]
