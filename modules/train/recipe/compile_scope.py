"""``compile.scope=AUTO`` for a run: which scope it compiles with, decided before the model
moves to the device (the measurement's processes load their own copy), and what every front
end plans with before a run has decided (the stored decision, else REGIONAL).

The decision and its storage are `modules.compile.scope_choice`; the measurement is the
benchmark's, run as a process of its own (`modules.bench.scope_measure`): one eager cell and
one per compiled scope, each a fresh process, a few steps each. The winning cell compiled the
run's own code for this setting, so its compile bundle is kept in the run's bundle folder and
the run loads it instead of compiling the same graphs a second time.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from modules.compile import compile_cache_folder
from modules.compile.bundle import BUNDLE_SUFFIX, BundleError, import_bundle, read_header
from modules.compile.scope_choice import (CANDIDATES, DECISIONS_FILE, EAGER,
                                          ScopeChoice, ScopeMeasurement, read_decisions,
                                          resolve_auto, scope_key)
from modules.config.schema import CompileBackend, CompileScope, Config
from modules.events import StopRequested
from modules.util.process import kill_group, last_log_line

STOP_POLL_SECONDS = 0.25

def bundle_folder(config: Config) -> Path:
    """Where runs write their compile bundles: the compile cache folder's bundles/."""
    cache = compile_cache_folder(config.compile.cache_dir, config.general.cache_dir)
    return cache.expanduser().resolve() / "bundles"


def decisions_path(config: Config) -> Path:
    """Where AUTO's decisions are kept: beside the compile bundles."""
    return bundle_folder(config) / DECISIONS_FILE


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


# A run's measurement: the candidates to measure and a folder where each measured compiled
# candidate's compile bundles are left, in a folder named for it (``keep/FULL/``)
RunMeasure = Callable[[tuple[str, ...], Path], Mapping[str, ScopeMeasurement | None]]


def resolve_compile_scope(config: Config, device: torch.device | str, *,
                          multi_process: bool = False, measure: RunMeasure | None = None,
                          notify: Callable[[str], None] = lambda text: None,
                          should_stop: Callable[[], bool] = lambda: False
                          ) -> tuple[Config, ScopeChoice | None]:
    """The run's config with AUTO decided, and the decision (None when the scope was not
    AUTO). Never raises for a measurement that fails: REGIONAL, with the reason. ``notify``
    is told before a measurement starts (it takes minutes); ``should_stop`` is polled while
    it runs, and a Stop ends its processes and raises StopRequested."""
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
    run_measure = measure or (lambda allowed, keep: measure_scopes(config, allowed, keep,
                                                                   should_stop))
    work: list[Path] = []

    def measured(allowed: tuple[str, ...]) -> Mapping[str, ScopeMeasurement | None]:
        # the cells' bundles wait in a folder inside bundles/ (the same disk: no copy of large
        # files across file systems; runs look for bundles only at its top) until the winner
        # is known; a folder that cannot be made fails the measurement, which AUTO reports
        bundle_folder(config).mkdir(parents=True, exist_ok=True)
        work.append(Path(tempfile.mkdtemp(prefix="scope-measurement-", dir=bundle_folder(config))))
        shown = ", ".join("eager" if name == EAGER else name for name in allowed)
        notify(f"compile.scope AUTO: measuring {shown} for {key} (a few steps each, in "
               "processes of their own, once for this setting; the compiled ones compile "
               "cold, so this takes minutes)")
        return run_measure(allowed, work[-1])

    try:
        choice = resolve_auto(key, decisions_path(config), measured, allowed_scopes(config),
                              cannot)
        if work and choice.source == "measured" and config.compile.bundles:
            winner = sorted((work[-1] / choice.chosen).glob(f"*{BUNDLE_SUFFIX}"))
            adopt_winner_bundle(choice, winner, bundle_folder(config))
    finally:
        for folder in work:
            shutil.rmtree(folder, ignore_errors=True)
    return with_scope(config, choice.chosen), choice


def adopt_winner_bundle(choice: ScopeChoice, bundles: list[Path], folder: Path) -> None:
    """Put the winning cell's compile bundles in the run's bundle folder, where the run finds
    the one made for its settings, and say so in ``choice``. A bundle already there for the
    same settings is kept (an earlier run may have compiled more shapes); one that cannot be
    read or written is named in ``choice.problems`` and the run compiles as it would have."""
    kept = []
    for path in bundles:
        try:
            target = folder / read_header(path).fingerprint.file_name()
            if not target.exists():
                import_bundle(path, folder)
            kept.append(target)
        except BundleError as err:
            choice.problems.append(f"the measured {choice.chosen} cell's compile bundle was "
                                   f"not kept: {err}")
    if kept:
        choice.why += (f"; the measured {choice.chosen} cell's compile bundle is in "
                       f"{folder}, so this run loads its compiled code instead of compiling "
                       "it again")


def measure_scopes(config: Config, allowed: tuple[str, ...], keep: Path | None = None,
                   should_stop: Callable[[], bool] = lambda: False
                   ) -> Mapping[str, ScopeMeasurement | None]:
    """The steady and first step of eager and of each allowed compiled scope, from a short
    benchmark of this config (`modules.bench.scope_measure`, a process of its own that starts
    one fresh process per candidate); None for a cell that failed, timed out or fell back to
    another backend. A measurement process that fails raises, and AUTO falls back. With
    ``keep``, each measured compiled candidate's compile bundles are kept in
    ``keep/<candidate>/``. ``should_stop`` is polled: a Stop kills the measurement and its
    cells (their process group) and raises StopRequested."""
    import subprocess
    import sys
    import time

    from modules.config import save_config
    repo = Path(__file__).resolve().parents[3]
    with tempfile.TemporaryDirectory(prefix="tempera-scope-") as work:
        config_file, out = Path(work) / "config.json", Path(work) / "measured.json"
        save_config(with_scope(config, "REGIONAL"), config_file)
        command = [sys.executable, "-m", "modules.bench.scope_measure", "--config",
                   str(config_file), "--allowed", ",".join(allowed), "--out", str(out)]
        log_path = Path(work) / "measure.log"
        with open(log_path, "w", encoding="utf-8") as log:
            process = subprocess.Popen(command + (["--bundles", str(keep)] if keep else []),
                                       cwd=repo, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)  # its cells in its group
            while process.poll() is None:
                if should_stop():
                    kill_group(process)
                    raise StopRequested("stopped while compile.scope AUTO was measuring")
                time.sleep(STOP_POLL_SECONDS)
        if process.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the scope measurement failed (exit {process.returncode}): "
                               f"{last_log_line(log_path)}")
        raw = json.loads(out.read_text(encoding="utf-8"))
    return {name: ScopeMeasurement(**numbers) if numbers else None
            for name, numbers in raw.items()}
