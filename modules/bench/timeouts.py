"""How long a benchmark cell may run: scaled with the model and the backend, overridable.

A fixed limit is wrong both ways: 15 minutes is hours too long for the tiny model and too short
for an SD-size UNet compiled with autotuning, which can spend more than that benchmarking kernel
choices. A cell killed by its limit is a ``timeout`` row, never a failure of its backend, and
``--apply`` refuses to pick a winner while one of the cells did not finish.
"""
from __future__ import annotations

import json

from modules.config import Config
from modules.config.schema import CompileBackend, CompileMode

# Model load, the eager steps and a small model's compile on a slow machine (the tiny UNet's
# inductor cold start is ~110 s on a 2-core CPU).
BASE_SECONDS = 600.0
# Compile time grows with the graph: an SD 1.5 UNet (860 M parameters) adds ~14 minutes.
SECONDS_PER_MILLION_PARAMETERS = 1.0
# max_autotune times several kernel choices per matrix product and convolution.
AUTOTUNE_FACTOR = 3.0


def autotunes(backend: str, mode: CompileMode = CompileMode.DEFAULT) -> bool:
    """Whether ``backend`` (a `CompileBackend` value) under ``mode`` autotunes, from the table."""
    from modules.compile.backends import BACKENDS, merged_inductor_options

    try:
        row = BACKENDS.get(CompileBackend(backend))
    except ValueError:  # an unknown name fails in its cell at once
        return False
    if row is None or not row.compiles:
        return False
    options = merged_inductor_options(row, mode)
    return bool(options.get("max_autotune") or options.get("max_autotune_gemm"))


def cell_timeout_seconds(denoiser_parameters: int, backend: str,
                         mode: CompileMode = CompileMode.DEFAULT) -> float:
    """Seconds one cell process may run before it is killed and recorded as ``timeout``."""
    seconds = BASE_SECONDS
    if backend != CompileBackend.NONE.value:
        seconds += SECONDS_PER_MILLION_PARAMETERS * denoiser_parameters / 1e6
        if autotunes(backend, mode):
            seconds *= AUTOTUNE_FACTOR
    return round(seconds)


def denoiser_parameters(config: Config) -> tuple[int, str]:
    """(parameters of the config's denoiser, a UNet or a transformer, and the config file the
    number came from), without loading weights: the denoiser is built from its config on the
    meta device, as the class its config names. The config is the model folder's (a built-in
    model is built into the cache first, as training does: it is tiny), else, for a single-file
    checkpoint, the one the family ships for reading single files."""
    import diffusers
    import torch

    from modules.bench.models import CONFIGS_DIR
    from modules.model_types import MODEL_TYPES
    from modules.models.families import family_files
    from modules.models.loader import resolve_model_path
    from modules.paths import cache_dir_for

    denoiser = MODEL_TYPES[config.model.type].denoiser
    folder = resolve_model_path(config.model.path, cache_dir_for(config.general.cache_dir))
    config_file = folder / denoiser / "config.json"
    if not config_file.is_file():
        shipped = family_files(config.model.type).single_file_configs
        config_file = CONFIGS_DIR / shipped / denoiser / "config.json"
    data = json.loads(config_file.read_text(encoding="utf-8"))
    with torch.device("meta"):
        model = getattr(diffusers, data["_class_name"]).from_config(data)
    return sum(p.numel() for p in model.parameters()), str(config_file)
