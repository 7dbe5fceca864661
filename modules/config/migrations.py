"""Ordered migrations of config files: each takes the data of version N to version N + 1.

A file without `config_version` is version 0 (written before the field existed). Adding a
migration means appending a function here and raising `CONFIG_VERSION` in the schema.
"""
from __future__ import annotations

import json
from collections.abc import Callable

from modules.config.problems import Problem
from modules.config.schema import CONFIG_VERSION


def _v0_to_v1(data: dict) -> dict:
    """Version 0 files named the compile backend `compile.mode` (as the design page's GUI does).

    Version 1 calls it `compile.backend` and uses `compile.mode` for torch.compile's mode.
    """
    compile_section = data.get("compile")
    if isinstance(compile_section, dict) and "mode" in compile_section \
            and "backend" not in compile_section:
        compile_section = dict(compile_section)
        compile_section["backend"] = compile_section.pop("mode")
        data = {**data, "compile": compile_section}
    return data


# Keys renamed by a migration, old dotted prefix -> new: `--set` accepts the old ones too.
RENAMED_KEYS: dict[str, str] = {"components.unet": "components.denoiser",
                                "compile.unet": "compile.denoiser"}


def _v1_to_v2(data: dict) -> dict:
    """Version 1 named the denoiser by SD's, `components.unet` and `compile.unet`; version 2
    says `denoiser`, whatever the model family calls it (a UNet for SD 1.x, 2.x and SDXL)."""
    for section in ("components", "compile"):
        part = data.get(section)
        if isinstance(part, dict) and "unet" in part and "denoiser" not in part:
            part = {("denoiser" if key == "unet" else key): value for key, value in part.items()}
            data = {**data, section: part}
    return data


def renamed_key(dotted: str) -> str:
    """`dotted` under its current name (`components.unet.train` -> `components.denoiser.train`)."""
    for old, new in RENAMED_KEYS.items():
        if dotted == old or dotted.startswith((old + ".", old + "[")):
            return new + dotted[len(old):]
    return dotted


# MIGRATIONS[n] takes version n to n + 1.
MIGRATIONS: list[Callable[[dict], dict]] = [_v0_to_v1, _v1_to_v2]
assert len(MIGRATIONS) == CONFIG_VERSION, "every schema version needs a migration"


def migrate(data: dict, problems: list[Problem]) -> dict:
    """Bring `data` up to CONFIG_VERSION; a version from the future or of a bad type is a problem."""
    version = data.get("config_version", 0)
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        problems.append(Problem("config_version", f"an integer from 0 to {CONFIG_VERSION}",
                                json.dumps(version)))
        return {k: v for k, v in data.items() if k != "config_version"}
    if version > CONFIG_VERSION:
        problems.append(Problem("config_version", f"at most {CONFIG_VERSION}", str(version),
                                "this file was written by a newer Tempera"))
        return {k: v for k, v in data.items() if k != "config_version"}
    for step in MIGRATIONS[version:]:
        data = step(data)
    return {**data, "config_version": CONFIG_VERSION}
