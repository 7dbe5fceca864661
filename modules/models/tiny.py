"""The built-in tiny models (`builtin:tiny-…`): where each is cached and when it is rebuilt.

Every family's record builds its own tiny, randomly initialised model (`ModelFamily.build_tiny`:
the SD families' in modules/models/tiny_sd.py, the transformer families' in their tiny modules)
and says what decides its weights and layout (`ModelFamily.tiny_spec`). This module asks the
record, never the model type: a folder is named after the built-in name and a fingerprint of
that spec, built once into the cache and published only when complete.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from modules.model_types import BUILTIN_MODEL_TYPES, BUILTIN_PREFIX, ModelType
from modules.models.families import family_of
from modules.models.tiny_text import CORPUS_PATH
from modules.util.atomic import publish_dir_once

# Bump when a builder changes in a way its spec does not show (e.g. tokenizer layout): it is
# part of the cache fingerprint, so old cached folders are not reused.
BUILDER_VERSION = 2

BUILTIN_MODELS = BUILTIN_MODEL_TYPES  # each family's record names its built-in tiny model


def spec_fingerprint(spec: Any) -> str:
    """A short hash of the spec (a dataclass or a dict), the builder version and the tokenizer
    corpus."""
    payload = json.dumps({
        "builder_version": BUILDER_VERSION,
        "spec": (dataclasses.asdict(spec)
                 if dataclasses.is_dataclass(spec) and not isinstance(spec, type) else spec),
        "corpus_sha256": hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest(),
    }, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:12]


def builtin_model_dir(name: str, cache_dir: Path) -> Path:
    """Where the built-in model `name` lives (or will live) in `cache_dir`."""
    short_name = name.removeprefix(BUILTIN_PREFIX)
    return Path(cache_dir) / "models" / f"{short_name}-{spec_fingerprint(tiny_spec(name))}"


def tiny_spec(name: str) -> Any:
    """What decides the built-in model `name`'s weights and layout (its cache fingerprint),
    as its family's record says."""
    return family_of(_builtin_type(name)).tiny_spec()


def builtin_identity(path: str) -> str | None:
    """What a built-in model *is*, read from the cache folder it was built into
    (`builtin_model_dir`): its name and spec fingerprint, e.g. "builtin:tiny-sd15@3f2a9c0d1e4b".
    The same model built into two cache folders has one identity; a changed builder (another
    fingerprint) has another. None for a path that is not a built-in model's folder."""
    folder = Path(path)
    short, _, fingerprint = folder.name.rpartition("-")
    name = BUILTIN_PREFIX + short
    if (folder.parent.name != "models" or name not in BUILTIN_MODELS
            or len(fingerprint) != 12 or fingerprint.strip("0123456789abcdef")):
        return None
    return f"{name}@{fingerprint}"


def ensure_builtin_model(name: str, cache_dir: Path) -> Path:
    """The folder of built-in model `name` (e.g. "builtin:tiny-sd15"), built on first use by
    its family's record.

    The folder appears only once complete, so a build that was interrupted is redone next time
    rather than half-loaded.
    """
    target = builtin_model_dir(name, cache_dir)
    if target.is_dir():
        return target
    family = family_of(_builtin_type(name))
    return publish_dir_once(target, lambda tmp: family.build_tiny(tmp, 0))


def _builtin_type(name: str) -> ModelType:
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; known: {', '.join(BUILTIN_MODELS)}")
    return BUILTIN_MODELS[name]
