"""``compile.scope=AUTO`` for a run: which scope it compiles with, decided before the model
moves to the device (the measurement's processes load their own copy), and what every front
end plans with before a run has decided (the stored decision, else REGIONAL).

The decision and its storage are `modules.compile.scope_choice`; the measurement is the
benchmark's, run as a process of its own (`modules.bench.scope_measure`): one eager cell and
one per compiled scope, each a fresh process, a few steps each.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import torch

from modules.compile import compile_cache_folder
from modules.compile.scope_choice import (CANDIDATES, DECISIONS_FILE, EAGER, Measure,
                                          ScopeChoice, ScopeMeasurement, read_decisions,
                                          resolve_auto, scope_key)
from modules.config.schema import CompileBackend, CompileScope, Config

def decisions_path(config: Config) -> Path:
    """Where AUTO's decisions are kept: beside the compile bundles."""
    cache = compile_cache_folder(config.compile.cache_dir, config.general.cache_dir)
    return cache.expanduser().resolve() / "bundles" / DECISIONS_FILE


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def config_key(config: Config, device: torch.device | str) -> str:
    return scope_key(device_name(device), config.model.type.value,
                     config.compile.backend.value, config.training.batch_size,
                     config.data.resolution)


def allowed_scopes(config: Config) -> tuple[str, ...]:
    """AUTO's candidates: FULL is left out where block offload needs the blocks compiled
    one by one (validation refuses FULL with offload)."""
    if config.model.offload_blocks:
        return tuple(c for c in CANDIDATES if c != "FULL")
    return CANDIDATES


def with_scope(config: Config, chosen: str) -> Config:
    """``config`` with AUTO replaced by ``chosen``; eager turns the denoiser's compile off."""
    if chosen == EAGER:
        settings = dataclasses.replace(config.compile, scope=CompileScope.REGIONAL,
                                       denoiser=False)
    else:
        settings = dataclasses.replace(config.compile, scope=CompileScope(chosen))
    return dataclasses.replace(config, compile=settings)


def planned_config(config: Config, device: torch.device | str | None = None) -> Config:
    """What a front end plans with before the run decides: AUTO as its stored decision for
    this setting, else REGIONAL (what AUTO compiles until it has measured)."""
    if config.compile.scope != CompileScope.AUTO:
        return config
    if device is None:
        from modules.train.recipe.builders import pick_device
        device = pick_device(config.general.device)
    decisions, _ = read_decisions(decisions_path(config))
    stored = decisions.get(config_key(config, device))
    chosen = stored["chosen"] if stored and stored["chosen"] in allowed_scopes(config) \
        else "REGIONAL"
    return with_scope(config, chosen)


def resolve_compile_scope(config: Config, device: torch.device | str, *,
                          multi_process: bool = False, measure: Measure | None = None
                          ) -> tuple[Config, ScopeChoice | None]:
    """The run's config with AUTO decided, and the decision (None when the scope was not
    AUTO). Never raises for a measurement that fails: REGIONAL, with the reason."""
    c = config.compile
    if c.scope != CompileScope.AUTO:
        return config, None
    key = config_key(config, device)
    if not c.denoiser or c.backend == CompileBackend.NONE:
        choice = ScopeChoice(key, "REGIONAL", "fallback",
                             "the denoiser is not compiled: nothing to measure")
        return with_scope(config, choice.chosen), choice
    cannot = ("a multi-process run does not measure (each process would need the device "
              "for the benchmark); run once on one process to decide") if multi_process else None
    choice = resolve_auto(key, decisions_path(config),
                          measure or (lambda allowed: measure_scopes(config, allowed)),
                          allowed_scopes(config), cannot)
    return with_scope(config, choice.chosen), choice


def measure_scopes(config: Config, allowed: tuple[str, ...]
                   ) -> Mapping[str, ScopeMeasurement | None]:
    """The steady and first step of eager and of each allowed compiled scope, from a short
    benchmark of this config (`modules.bench.scope_measure`, a process of its own that starts
    one fresh process per candidate); None for a cell that failed, timed out or fell back to
    another backend. A measurement process that fails raises, and AUTO falls back."""
    import subprocess
    import sys
    import tempfile

    from modules.config import save_config
    repo = Path(__file__).resolve().parents[3]
    with tempfile.TemporaryDirectory(prefix="tempera-scope-") as work:
        config_file, out = Path(work) / "config.json", Path(work) / "measured.json"
        save_config(with_scope(config, "REGIONAL"), config_file)
        done = subprocess.run(
            [sys.executable, "-m", "modules.bench.scope_measure", "--config", str(config_file),
             "--allowed", ",".join(allowed), "--out", str(out)],
            cwd=repo, capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the scope measurement failed (exit {done.returncode}): {tail}")
        raw = json.loads(out.read_text(encoding="utf-8"))
    return {name: ScopeMeasurement(**numbers) if numbers else None
            for name, numbers in raw.items()}
