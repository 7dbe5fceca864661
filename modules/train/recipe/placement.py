"""Where each component lives during a run: on the training device, or on the CPU because what
it computes is cached (issue 46, item 3). One rule for every family: a frozen component whose
outputs are all cached before training is not needed on the device at each step, so it stays
on the CPU and comes onto the device only for the passes that need it (`borrowed`), then
leaves again.

- the text encoder(s): captions cached before training (`text_encoder_leaves_device`: cached
  outputs, no encoder trained, no caption that changes per step, a pipeline that takes
  encoded prompts); samples are then drawn from the cached prompts, so the encoders are not
  borrowed at all;
- the VAE: latents cached (`data.cache_latents`) and the VAE not trained; it is borrowed to
  encode validation's fixed batches (once) and to decode each sampling pass's images.

The memory plan (train/memory/memory_plan.py) counts a component that leaves only as what it
needs while it is borrowed, and run.json's `placement` says where each component lived.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from modules.config.schema import Config
from modules.model_types import MODEL_TYPES
from modules.train.recipe import text_cache
from modules.train.recipe.text_cache import text_encoder_leaves_device
from modules.train.recipe.trainable import trained_components


def _vae_leaves(config: Config) -> bool:
    return config.data.cache_latents and "vae" not in trained_components(config)


# (which components, when they leave the device, why, when they come back): one row per kind
# of cached output. Adding a cached output is adding a row.
OFF_DEVICE_RULES: tuple[tuple[str, Callable[[Config], bool], str, str], ...] = (
    ("text_encoders", text_encoder_leaves_device,
     "every caption's text encoder output is cached before training (data."
     "cache_text_encoder_outputs)",
     "never: samples are drawn from the cached prompts"),
    ("vae", _vae_leaves,
     "every image's latents are cached before training (data.cache_latents)",
     "for each sampling pass (to decode) and once for validation's fixed batches (to encode)"),
)


def _rule_components(config: Config, which: str) -> tuple[str, ...]:
    spec = MODEL_TYPES[config.model.type]
    return spec.text_encoders if which == "text_encoders" else (which,)


def components_off_device(config: Config) -> dict[str, tuple[str, str]]:
    """Component name -> (why it is off the device, when it comes back) for each component
    this run keeps on the CPU; the rest stay on the training device for the whole run."""
    off: dict[str, tuple[str, str]] = {}
    for which, leaves, why, back in OFF_DEVICE_RULES:
        if leaves(config):
            off.update({name: (why, back) for name in _rule_components(config, which)})
    return off


def placement_record(config: Config, device: torch.device) -> dict[str, dict[str, str]]:
    """run.json's `placement`: where each component lived during the run, and why."""
    off = components_off_device(config)
    record = {}
    for name in MODEL_TYPES[config.model.type].components:
        if name in off:
            why, back = off[name]
            record[name] = {"device": "cpu", "why": why, "on the device": back}
        else:
            record[name] = {"device": device.type, "why": "needed at every step"}
    return record


@contextmanager
def borrowed(modules: dict[str, nn.Module], device: torch.device) -> Iterator[None]:
    """The modules on `device` for the block, each back where it was afterwards (also when the
    block raises): a component kept on the CPU comes onto the device for one pass only."""
    homes = {name: text_cache.module_device(m) for name, m in modules.items()}
    moved = {name: m for name, m in modules.items() if not text_cache.is_on(m, device)}
    for module in moved.values():
        module.to(device)
    try:
        yield
    finally:
        for name, module in moved.items():
            module.to(homes[name])
