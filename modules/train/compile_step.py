"""The trainer's side of compilation: hand the run's components to the compile engine.

The engine compiles what `compile.*` selects, guards the first micro-steps against lazy compile
failures (falling back one backend at a time), and reports per component for run.json.
"""
from __future__ import annotations

from pathlib import Path

import torch

from modules.compile import CompileEngine
from modules.config.schema import Config
from modules.events import TrainerCallbacks
from modules.models.loader import ModelBundle


def compile_cache_dir(config: Config) -> Path:
    """`compile.cache_dir`, or `<general.cache_dir>/compile` when it is empty."""
    if config.compile.cache_dir:
        return Path(config.compile.cache_dir)
    return Path(config.general.cache_dir) / "compile"


def build_compile_guard(config: Config, bundle: ModelBundle, device: torch.device,
                        params: dict, callbacks: TrainerCallbacks) -> CompileEngine:
    """Compile the selected components in place and return the engine that guards each step."""
    engine = CompileEngine(
        config.compile,
        {"unet": bundle.unet, "text_encoder": list(bundle.text_encoders.values()),
         "vae": bundle.vae},
        callbacks=callbacks, device=device,
        trainable_params=[p for plist in params.values() for p in plist],
        cache_dir=compile_cache_dir(config))
    engine.apply()
    return engine
