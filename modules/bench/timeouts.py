"""How long a benchmark cell may run: scaled with the model and the backend, overridable.

A fixed limit is wrong both ways: 15 minutes is hours too long for the tiny model and too short
for an SD-size UNet compiled with autotuning, which can spend more than that benchmarking kernel
choices. A cell killed by its limit is a ``timeout`` row, never a failure of its backend, and
``--apply`` refuses to pick a winner while one of the cells did not finish.
"""
from __future__ import annotations

import json
from pathlib import Path

from modules.config import Config
from modules.config.schema import CompileBackend, CompileMode, ModelType

# Model load, the eager steps and a small model's compile on a slow machine (the tiny UNet's
# inductor cold start is ~110 s on a 2-core CPU).
BASE_SECONDS = 600.0
# Compile time grows with the graph: an SD 1.5 UNet (860 M parameters) adds ~14 minutes.
SECONDS_PER_MILLION_PARAMETERS = 1.0
# max_autotune times several kernel choices per matrix product and convolution.
AUTOTUNE_FACTOR = 3.0
# When the UNet's own config cannot be read (a single-file checkpoint): the real sizes.
TYPICAL_UNET_PARAMETERS = {ModelType.SD15: 859_520_964, ModelType.SD2: 865_910_724,
                           ModelType.SDXL: 2_567_463_684}


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


def cell_timeout_seconds(unet_parameters: int, backend: str,
                         mode: CompileMode = CompileMode.DEFAULT) -> float:
    """Seconds one cell process may run before it is killed and recorded as ``timeout``."""
    seconds = BASE_SECONDS
    if backend != CompileBackend.NONE.value:
        seconds += SECONDS_PER_MILLION_PARAMETERS * unet_parameters / 1e6
        if autotunes(backend, mode):
            seconds *= AUTOTUNE_FACTOR
    return round(seconds)


def unet_parameters(config: Config) -> tuple[int, str]:
    """(parameters of the config's UNet, where the number came from), without loading weights:
    the UNet is built from its config on the meta device."""
    import diffusers
    import torch

    from modules.models.tiny import BUILTIN_MODELS, TINY_SPECS

    path = config.model.path
    if path in BUILTIN_MODELS:
        unet_config, source = dict(TINY_SPECS[BUILTIN_MODELS[path]].unet), path
    else:
        config_file = Path(path) / "unet" / "config.json"
        if not config_file.is_file():
            return (TYPICAL_UNET_PARAMETERS[config.model.type],
                    f"typical {config.model.type.value} UNet ({config_file} not found)")
        unet_config, source = json.loads(config_file.read_text(encoding="utf-8")), str(config_file)
    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel.from_config(unet_config)
    return sum(p.numel() for p in unet.parameters()), source
