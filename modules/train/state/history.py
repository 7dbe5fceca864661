"""How long compiling took the last time the same settings ran: the expected compile time a
front end shows while the first steps compile (a progress bar cannot know it otherwise).

One small JSON file in the compile cache folder, keyed by what decides the compile work: the
model, the compile settings, the components trained, the resolution, the device type and the
torch version. Each finished or stopped run records its compile seconds, apart for a warm
compile cache (every cached component a hit: seconds, not minutes) and a cold one, and how many
graphs each component compiled (for "graph N of M").
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.compile.cache import compile_cache_folder
from modules.config.data import trained_resolutions
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
    trained = trained_resolutions(config.data)
    if trained != [config.data.resolution]:  # only then: a single-resolution run keeps its key
        parts["resolutions"] = trained
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class CompileExpectation:
    """What the last runs with these settings say about the next compile."""
    seconds: float | None     # expected compile seconds (None: not measured for this case)
    warm: bool                # the compile cache should already hold these graphs
    cold_seconds: float | None  # a compile without the cache's help, when measured
    graphs: dict[str, int]    # per component, the graphs compiled last time ({} unknown)
    bundle: bool = False      # warm because a compile bundle for these settings is there
    measured: str | None = None  # no history here: what a GPU phase measured for them, as text


def record_compile_time(config: Config, device_type: str, report: dict[str, dict]) -> None:
    """Remember this run's compile seconds (summed over components) for its settings, apart
    for a warm cache (every cached component hit) and a cold one, and its graphs per
    component, so the next run's estimate and "graph N of M" fit the case it is in."""
    seconds = sum(float(r.get("compile_seconds") or 0) for r in report.values())
    if seconds <= 0:
        return
    path = history_path(config)
    entries = _read(path)
    key = compile_key(config, device_type)
    entry = entries.pop(key, None)
    entry = entry if isinstance(entry, dict) else {}
    caches = sorted({r.get("cache", "off") for r in report.values()})
    warm = "hit" in caches and "miss" not in caches
    entry.update({"seconds": round(seconds, 1), "cache": caches,
                  "warm_seconds" if warm else "cold_seconds": round(seconds, 1)})
    graphs = {name: int(r["compiles"]) for name, r in report.items() if r.get("compiles")}
    if graphs:
        entry["graphs"] = graphs
    entries[key] = entry  # last, so the oldest entries go first
    while len(entries) > KEPT:
        entries.pop(next(iter(entries)))
    atomic_write_text(path, json.dumps(entries, indent=1) + "\n")


def compile_expectation(config: Config, device_type: str,
                        bundle_cold_seconds: float | None | bool = False
                        ) -> CompileExpectation | None:
    """What to expect of this run's compile, or None when these settings never ran here and
    no compile bundle is there for them.

    A run that used the compile cache left these graphs in it: the next one is expected warm
    (its time measured on an earlier warm run, or unknown yet), unless the cache folder is gone.
    ``bundle_cold_seconds``: False without a compile bundle for these settings here; with one,
    the cold compile time it records (None: not recorded). The run will load it, so it is
    expected warm even on a machine these settings never ran on.
    """
    bundle = bundle_cold_seconds is not False
    bundle_cold = bundle_cold_seconds if isinstance(bundle_cold_seconds, float) else None
    entry = _read(history_path(config)).get(compile_key(config, device_type))
    if not isinstance(entry, dict) or "seconds" not in entry:
        return (CompileExpectation(seconds=None, warm=True, cold_seconds=bundle_cold, graphs={},
                                   bundle=True) if bundle else None)
    caches = entry.get("cache") or []
    cold = entry.get("cold_seconds", entry["seconds"] if "hit" not in caches else None)
    warm_seconds = entry.get("warm_seconds", entry["seconds"] if "miss" not in caches
                             and "hit" in caches else None)
    cache_used = "hit" in caches or "miss" in caches
    from modules.compile.cache import compile_cache_folder
    from modules.paths import cache_dir_for
    folder = compile_cache_folder(config.compile.cache_dir, cache_dir_for(config.general.cache_dir))
    # the history and the bundles a run writes are not compiled code in the cache
    cached = cache_used and folder.is_dir() and any(
        p.name not in (HISTORY_FILE, "bundles") for p in folder.iterdir())
    graphs = entry.get("graphs")
    if not isinstance(graphs, dict):
        graphs = {}
    warm = cached or bundle
    return CompileExpectation(seconds=warm_seconds if warm else cold, warm=warm,
                              cold_seconds=cold if cold is not None else bundle_cold,
                              graphs=graphs, bundle=bundle and not cached)


def with_measured(expected: CompileExpectation | None, config: Config, device_type: str
                  ) -> CompileExpectation | None:
    """``expected``, and for a first cold compile of these settings on a CUDA device (no
    history, no warm cache or bundle) what a GPU phase measured for the same family, backend
    and scope (`modules.compile.measured`), so the estimate is not empty on a new machine."""
    if device_type != "cuda" or (expected is not None and (expected.warm or expected.seconds)):
        return expected
    from modules.compile.measured import measured_compile
    found = measured_compile(config.model.type.value, config.compile.backend.value,
                             config.compile.scope.value)
    if found is None:
        return expected
    return dataclasses.replace(
        expected or CompileExpectation(seconds=None, warm=False, cold_seconds=None, graphs={}),
        measured=found.text())


def expected_compile_seconds(config: Config, device_type: str) -> float | None:
    """The expected compile seconds for these settings here, or None when unknown."""
    expectation = compile_expectation(config, device_type)
    return expectation.seconds if expectation else None
