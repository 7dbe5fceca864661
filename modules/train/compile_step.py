"""The trainer's side of compilation: build the guard that runs each micro-step.

Until the compile engine is wired in, every component runs eagerly and the report says so.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from modules.config.schema import Config
from modules.events import TrainerCallbacks
from modules.models.loader import ModelBundle


class EagerGuard:
    """Runs micro-steps as they are; reports every component as not compiled."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def run(self, step_fn: Callable[[], float]) -> float:
        return step_fn()

    def report(self) -> dict:
        requested = self.config.compile.backend.value
        return {name: {"requested": requested if getattr(self.config.compile, name) else "NONE",
                       "effective": "NONE"} for name in ("unet", "text_encoder", "vae")}


def build_compile_guard(config: Config, bundle: ModelBundle, device: torch.device,
                        params: dict, callbacks: TrainerCallbacks) -> EagerGuard:
    return EagerGuard(config)
