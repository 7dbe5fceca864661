"""ComfyUI's split files: a diffusion model, a text encoder and a VAE, three .safetensors files
named by `model.path`, `model.text_encoder_path` and `model.vae_path`. Checked from their
headers alone (nothing loaded): each file there, readable, and the part its field names. The
families that take them say, in their file-layout modules, what each part is (`part_of`) and
what else the three must agree on.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from modules.config.problems import Problem

Keys = dict[str, tuple[int, ...]]
# the field that names each part
FIELDS = {"transformer": "model.path", "text_encoder": "model.text_encoder_path",
          "vae": "model.vae_path"}


def keys_of(path: Path) -> Keys:
    """A .safetensors file's tensor names and shapes, read from its header only."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def check_parts(model: Any, family: str, labels: Mapping[str, str],
                part_of: Callable[[Keys], tuple[str | None, str]]
                ) -> tuple[list[Problem], dict[str, Keys]]:
    """Every problem with the three files (a field left empty, no such file, not a
    .safetensors file, an unreadable header, a file that is another part or no part of
    `family`'s), each naming its field, the file and what was expected; and the keys of each
    file that could be read, by the part its field names."""
    given = {part: getattr(model, field.removeprefix("model.")) for part, field in FIELDS.items()}
    problems: list[Problem] = []
    read: dict[str, Keys] = {}
    for part, value in given.items():
        field, expected = FIELDS[part], labels[part]
        if not value:
            problems.append(Problem(field, f"the .safetensors file of {expected}", "''",
                                    f"a {family} diffusion-model file comes without its text "
                                    "encoder and VAE: name each file (ComfyUI keeps them in "
                                    "models/text_encoders and models/vae)"))
            continue
        path = Path(value)
        if not path.is_file() or path.suffix.lower() != ".safetensors":
            problems.append(Problem(field, f"the .safetensors file of {expected}", repr(value),
                                    "no such file" if not path.exists() else "not a "
                                    ".safetensors file"))
            continue
        try:
            keys = keys_of(path)
        except Exception as exc:  # safetensors raises its own error type for a bad header
            problems.append(Problem(field, expected, repr(value), f"not a readable "
                                    f".safetensors file ({exc}); the download may be "
                                    "incomplete"))
            continue
        found, what = part_of(keys)
        if found != part:
            hint = f"; it belongs in {FIELDS[found]}" if found else ""
            problems.append(Problem(field, expected, repr(value), f"{path.name} is {what}{hint}"))
        read[part] = keys
    return problems, read
