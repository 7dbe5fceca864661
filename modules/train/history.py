"""How long compiling took the last time the same settings ran: the expected compile time a
front end shows while the first steps compile (a progress bar cannot know it otherwise).

One small JSON file in the compile cache folder, keyed by what decides the compile work: the
model, the compile settings, the components trained, the resolution, the device type and the
torch version. Each finished or stopped run records its compile seconds (cold or warm cache,
as it happened, with which).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from modules.compile.cache import compile_cache_folder
from modules.config.loader import to_dict
from modules.config.schema import Config
from modules.util.atomic import atomic_write_text

HISTORY_FILE = "compile_history.json"
KEPT = 200  # entries; the oldest go first


def history_path(config: Config) -> Path:
    from modules.paths import cache_dir_for
    return compile_cache_folder(config.compile.cache_dir,
                                cache_dir_for(config.general.cache_dir)) / HISTORY_FILE


def compile_key(config: Config, device_type: str) -> str:
    """What decides how much compiling a run does, as a short hash (of the config as the user
    gave it: a `builtin:` name, not the cache folder it resolves to)."""
    import torch
    data = to_dict(config)
    parts = {"model": data["model"]["path"], "type": data["model"]["type"],
             "compile": data["compile"], "components": data["components"],
             "method": data["training"]["method"], "resolution": data["data"]["resolution"],
             "buckets": data["data"]["aspect_buckets"], "checkpointing":
             data["training"]["gradient_checkpointing"],
             "channels_last": data["training"]["channels_last"], "device": device_type,
             "torch": torch.__version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_compile_time(config: Config, device_type: str, report: dict[str, dict]) -> None:
    """Remember this run's compile seconds (summed over components) for its settings."""
    seconds = sum(float(r.get("compile_seconds") or 0) for r in report.values())
    if seconds <= 0:
        return
    path = history_path(config)
    entries = _read(path)
    entries[compile_key(config, device_type)] = {
        "seconds": round(seconds, 1),
        "cache": sorted({r.get("cache", "off") for r in report.values()})}
    while len(entries) > KEPT:
        entries.pop(next(iter(entries)))
    atomic_write_text(path, json.dumps(entries, indent=1) + "\n")


def expected_compile_seconds(config: Config, device_type: str) -> float | None:
    """The compile seconds of the last run with these settings here, or None if none ran."""
    entry = _read(history_path(config)).get(compile_key(config, device_type))
    return float(entry["seconds"]) if entry else None
