"""Load the model a config names: a built-in tiny model (built into the cache once), a
diffusers folder or a single-file checkpoint, each handed to its family's loader."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from modules.config.schema import BUILTIN_PREFIX, ModelConfig
from modules.model_types import MODEL_TYPES
from modules.models.bundle import Dtypes, ModelBundle
from modules.models.families import family_of
from modules.models.families.base import TextFirst
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
    return _rescaled(bundle, model)


def load_text_part(model_path: Path, model: ModelConfig, dtypes: Dtypes
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The text encoders and tokenizers of `model.type`'s folder alone (its family's
    `text_first`), for a run that encodes its captions before the rest loads."""
    return _text_first(model).load_text(Path(model_path), model, dtypes)


def load_tokenizers(model_path: Path, model: ModelConfig) -> dict[str, Any]:
    """The tokenizers of `model.type`'s folder alone (its family's `text_first`)."""
    return _text_first(model).load_tokenizers(Path(model_path), model)


def load_without_text_encoders(model_path: Path, model: ModelConfig, dtypes: Dtypes,
                               tokenizers: dict[str, Any]) -> ModelBundle:
    """`load_bundle` but for the text encoders (`text_encoders` empty; `tokenizers` as
    `load_text_part` read them): what a run loads once its captions are encoded."""
    return _rescaled(_text_first(model).load_rest(Path(model_path), model, dtypes, tokenizers),
                     model)


def _text_first(model: ModelConfig) -> TextFirst:
    text_first = family_of(model.type).text_first
    if text_first is None:  # text_encoder_first refuses it before loading; said again here
        raise ValueError(f"{MODEL_TYPES[model.type].label} models load their text encoders "
                         "with the rest only")
    return text_first


def _rescaled(bundle: ModelBundle, model: ModelConfig) -> ModelBundle:
    """The bundle, its noise schedule rescaled for zero terminal SNR when asked."""
    if model.zero_terminal_snr:
        rescale = family_of(model.type).objective.zero_terminal_snr
        if rescale is None:  # refused before loading (train/recipe/loss_checks.py); said again here
            raise ValueError(f"{MODEL_TYPES[model.type].label} models have no noise schedule "
                             "to rescale for zero terminal SNR")
        bundle.noise_scheduler = rescale(bundle.noise_scheduler)
    return bundle
