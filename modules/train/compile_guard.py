"""The trainer's side of compilation: hand the run's components to the compile engine.

The engine compiles what `compile.*` selects, guards every training micro-step against lazy
compile failures (falling back one backend at a time), and reports per component for run.json.
How each component is trained (checkpointing, accumulation) is passed along because it decides
whether CUDA graphs can stay on.
"""
from __future__ import annotations

import torch

from modules.compile import CompileEngine, ComponentTraining, compile_cache_folder
from modules.config.schema import Config
from modules.model_types import MODEL_TYPES
from modules.events import TrainerCallbacks
from modules.compile.regions import REPEATED_BLOCKS
from modules.models.loader import ModelBundle

# The compile engine's (and run.json's) name for the denoiser, whatever its family calls it:
# `compile.denoiser` selects it.
COMPILE_DENOISER = "unet"


def component_training(config: Config, trained: list[str]) -> dict[str, ComponentTraining]:
    """Per compile component, how this run trains it (text encoders count as one component)."""
    t = config.training

    def how(is_trained: bool) -> ComponentTraining:
        return ComponentTraining(trained=is_trained,
                                 gradient_checkpointing=is_trained and t.gradient_checkpointing,
                                 accumulation=t.gradient_accumulation)

    denoiser = MODEL_TYPES[config.model.type].denoiser
    return {COMPILE_DENOISER: how(denoiser in trained),
            "text_encoder": how(any(n.startswith("text_encoder") for n in trained)),
            "vae": how(False)}


def build_compile_guard(config: Config, bundle: ModelBundle, device: torch.device,
                        params: dict, trained: list[str],
                        callbacks: TrainerCallbacks) -> CompileEngine:
    """Compile the selected components in place and return the engine that guards each step.
    REGIONAL compiles the denoiser's repeated blocks that its family names."""
    engine = CompileEngine(
        config.compile,
        {COMPILE_DENOISER: bundle.denoiser, "text_encoder": list(bundle.text_encoders.values()),
         "vae": bundle.vae},
        regional_blocks={**REPEATED_BLOCKS, COMPILE_DENOISER: bundle.family.repeated_blocks},
        callbacks=callbacks, device=device,
        trainable_params=[p for plist in params.values() for p in plist],
        training=component_training(config, trained),
        cache_dir=compile_cache_folder(config.compile.cache_dir, config.general.cache_dir))
    engine.apply()
    return engine
