"""What a config does that runs but that the user should hear of before training: settings it
leaves unused though they were set (FINE_TUNE with a LOHA adapter trains no LoHa), and a DoRA
text encoder saved in the diffusers layout (its magnitudes are dropped on load). Not problems:
the run is valid and does what the rest of the config says.

Said once, before training, by every front end that starts a run (`check_run`: status lines,
and `tempera-train --check`) and recorded in run.json (`warnings`).
"""
from __future__ import annotations

import os
from typing import Any

from modules.config.field_rules import unused_fields
from modules.config.introspect import iter_fields
from modules.config.schema import (Adapter, Config, DistributedStrategy, SaveFormat,
                                   TrainingMethod)


def value_at(config: Any, dotted_path: str) -> Any:
    """The value of a field named by its dotted path (no list items)."""
    for name in dotted_path.split("."):
        config = getattr(config, name)
    return config


def _shown(value: Any) -> str:
    return str(getattr(value, "value", value))


def unused_settings(config: Config) -> dict[str, str]:
    """{dotted path: warning} for each setting the config leaves unused
    (modules/config/field_rules.py) although it differs from its default: a value the user
    chose that will do nothing."""
    defaults = {info.dotted_path: info.default for info in iter_fields(Config)}
    found = {}
    for path, why in unused_fields(config).items():
        value = value_at(config, path)
        if value != defaults[path]:
            found[path] = (f"{path} is {_shown(value)}, but it is not used: {why} (set it "
                           f"back to {_shown(defaults[path])}, or change what leaves it unused)")
    return found


# diffusers' loader hands a text encoder's LoRA to transformers' peft integration, which
# drops the DoRA magnitudes as unexpected keys (a file written by diffusers' own saver fails
# the same way): docs/adapters.md, "DoRA".
DORA_TEXT_ENCODER = ("training.adapter is DORA with a trained text encoder and the DIFFUSERS "
                     "format: diffusers loads the text encoder's DoRA without its trained "
                     "magnitudes (an upstream limit, docs/adapters.md), so in diffusers it acts "
                     "as a plain LoRA; the UNet's DoRA loads exactly. For the text encoder's "
                     "DoRA as trained, add KOHYA to output.formats and load that file with "
                     "LyCORIS, which applies it exactly; ComfyUI and Forge render a DoRA "
                     "approximately and A1111's built-in loader mis-applies it")


def config_warnings(config: Config) -> list[str]:
    """Every caveat of `config`, one line each, before training."""
    warnings = list(unused_settings(config).values())
    t = config.training
    trains_text = any(getattr(config.components, name).train
                      for name in ("text_encoder", "text_encoder_2"))
    if (t.method == TrainingMethod.LORA and t.adapter == Adapter.DORA and trains_text
            and SaveFormat.DIFFUSERS in config.output.formats):
        warnings.append(DORA_TEXT_ENCODER)
    if t.distributed_strategy != DistributedStrategy.DDP and not several_processes():
        warnings.append(f"training.distributed_strategy is {t.distributed_strategy.value}, "
                        "but it is not used: this is one process, so nothing is sharded (launch "
                        "with accelerate launch or torchrun --nproc_per_node N to shard, or set "
                        "it back to DDP)")
    return warnings


def several_processes() -> bool:
    """Whether a launcher started several processes (WORLD_SIZE is the launchers' documented
    contract with the processes they start; train/recipe/distributed.py reads it the same)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1
