"""Flux.2 Klein's files, checked before anything is written: a `Flux2KleinPipeline` diffusers
folder whose transformer takes what its text encoder gives (the 9B transformer reads Qwen3-8B,
the 4B Qwen3-4B: three stacked hidden layers), and the step-distilled Klein models named as
such and refused unless `model.train_distilled` says otherwise.

What marks a distilled Klein is data, read from the folder's `model_index.json`
(`DISTILLED_MARKERS`): Flux2KleinPipeline registers `is_distilled` in its config, the released
FLUX.2-klein-4B and -9B say `"is_distilled": true`, the base models leave it out (False).
ComfyUI's split files are not read yet: a file is refused, naming what to give instead.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from modules.config.problems import Problem

# model_index.json key -> the value that marks a step-distilled model
DISTILLED_MARKERS: dict[str, Any] = {"is_distilled": True}
# the hidden layers Flux2KleinPipeline stacks (text_encoder_out_layers' default): the
# transformer's caption features are len(...) x the encoder's width
STACKED_LAYERS = (9, 18, 27)
BASE_MODELS = ("black-forest-labs/FLUX.2-klein-base-4B", "black-forest-labs/FLUX.2-klein-base-9B")


def _read_json(path: Path) -> dict | None:
    """A JSON file's object, or None when it is missing or unreadable (the shared folder
    checks name those)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def distilled_reason(folder: Path) -> str | None:
    """Why the folder holds a step-distilled Klein, or None: a marker of `DISTILLED_MARKERS`
    in its model_index.json."""
    index = _read_json(folder / "model_index.json") or {}
    for key, value in DISTILLED_MARKERS.items():
        if index.get(key) == value:
            return f"{folder / 'model_index.json'} says {key}: {json.dumps(value)}"
    return None


def distilled_problems(model: Any) -> list[Problem]:
    """Refuse the step-distilled Klein unless model.train_distilled, saying what to train."""
    why = distilled_reason(Path(model.path))
    if why is None or model.train_distilled:
        return []
    return [Problem("model.path", "a Flux.2 Klein base model", repr(model.path),
                    f"this is a step-distilled Klein ({why}): training it breaks its "
                    "distillation (LoRAs come out blurred or off-subject). Train the base model "
                    f"({' or '.join(BASE_MODELS)}) and apply the LoRA to the distilled one "
                    "afterwards; set model.train_distilled=true to train it anyway")]


def width_problems(folder: Path) -> list[Problem]:
    """The transformer's caption width against the text encoder's: a 9B transformer with the
    4B encoder (or the reverse) is refused, naming both configs."""
    transformer = _read_json(folder / "transformer" / "config.json")
    encoder = _read_json(folder / "text_encoder" / "config.json")
    if transformer is None or encoder is None:
        return []  # the shared folder checks name a missing or unreadable config
    takes, hidden = transformer.get("joint_attention_dim"), encoder.get("hidden_size")
    if not isinstance(takes, int) or not isinstance(hidden, int):
        return [Problem("model.path", "a Flux.2 Klein folder", repr(str(folder)),
                        "its transformer/config.json has no joint_attention_dim or its "
                        "text_encoder/config.json no hidden_size")]
    if takes != len(STACKED_LAYERS) * hidden:
        return [Problem("model.path", "a Klein transformer and the text encoder it was trained "
                        "with", repr(str(folder)),
                        f"{folder / 'transformer' / 'config.json'} takes caption features of "
                        f"{takes} = {len(STACKED_LAYERS)} layers x {takes // len(STACKED_LAYERS)}"
                        f", but {folder / 'text_encoder' / 'config.json'} is {hidden} wide "
                        "(Klein 4B reads Qwen3-4B, 2560; 9B reads Qwen3-8B, 4096)")]
    return []


def input_problems(model: Any, single_file: bool) -> list[Problem]:
    """What is wrong with Klein's files beyond the shared folder checks."""
    if single_file:
        return [Problem("model.path", "a Flux2KleinPipeline diffusers folder", repr(model.path),
                        "Flux.2 Klein from ComfyUI's single files is not supported yet: give "
                        "the diffusers folder (model_index.json, transformer/, text_encoder/, "
                        "tokenizer/, vae/, scheduler/)")]
    return width_problems(Path(model.path)) + distilled_problems(model)
