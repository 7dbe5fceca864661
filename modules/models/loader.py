"""Load the model a config names: a built-in tiny model (built into the cache once), a
diffusers folder or a single-file checkpoint, each handed to its family's loader."""
from __future__ import annotations

from pathlib import Path

from modules.config.schema import BUILTIN_PREFIX, ModelConfig
from modules.model_types import MODEL_TYPES
from modules.models.bundle import Dtypes, ModelBundle
from modules.models.families import family_of
from modules.models.single_file import is_single_file
from modules.models.tiny import ensure_builtin_model


def resolve_model_path(path: str, cache_dir: Path) -> Path:
    """The real folder behind a model path; built-in models are built once into the cache."""
    if path.startswith(BUILTIN_PREFIX):
        return ensure_builtin_model(path, cache_dir)
    return Path(path)


def load_bundle(model_path: Path, model: ModelConfig, dtypes: Dtypes) -> ModelBundle:
    """Load a diffusers folder, or a single-file checkpoint, of `model.type`'s family, each
    component at its dtype (`train.weights.component_dtypes` says which), its noise schedule
    rescaled for zero terminal SNR when `model.zero_terminal_snr` is on (training, samples
    and saved schedulers then all use it)."""
    family = family_of(model.type)
    if is_single_file(model_path):
        if family.load_single_file is None:
            raise ValueError(f"{model_path}: {MODEL_TYPES[model.type].label} models load from "
                             "a diffusers folder only")
        bundle = family.load_single_file(model_path, model, dtypes)
    else:
        bundle = family.load_folder(Path(model_path), model.prediction_type, dtypes)
    if model.zero_terminal_snr:
        rescale = family.objective.zero_terminal_snr
        if rescale is None:  # refused before loading (train/recipe/loss_checks.py); said again here
            raise ValueError(f"{MODEL_TYPES[model.type].label} models have no noise schedule "
                             "to rescale for zero terminal SNR")
        bundle.noise_scheduler = rescale(bundle.noise_scheduler)
    return bundle
