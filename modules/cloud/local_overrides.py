"""Machine-local overrides: a JSON file of `{"dotted.key": value}` pairs, never committed.

What legitimately differs per machine (where the dataset lives on the cloud disk, the device,
the cache folder) goes here instead of into the committed config. The file is passed explicitly
(`tempera-train --local FILE`, `install-hook --local FILE`); nothing reads it implicitly.
Relative path values in it are relative to the file's folder. Precedence: config file, then this
file, then `--set`.
"""
from __future__ import annotations

import json
from pathlib import Path

from modules.config import Config, ConfigError, Problem, apply_overrides
from modules.config.loader import read_json


def local_assignments(path: Path) -> list[str]:
    """The file's pairs as `--set` style `key=value` texts; a malformed file is a ConfigError."""
    data = read_json(Path(path))
    if not isinstance(data, dict):
        raise ConfigError([Problem("(top level)", 'a JSON object of {"dotted.key": value} pairs',
                                   type(data).__name__)], str(path))
    assignments = []
    for key, value in data.items():
        text = value if isinstance(value, str) else json.dumps(value)
        assignments.append(f"{key}={text}")
    return assignments


def apply_local_overrides(config: Config, path: Path) -> Config:
    """The config with the local file's overrides applied (paths relative to the file's folder)."""
    path = Path(path)
    try:
        return apply_overrides(config, local_assignments(path), cwd=path.resolve().parent)
    except ConfigError as exc:
        raise ConfigError(exc.problems, f"local overrides {path}") from None
