"""Run a benchmark matrix: one subprocess per cell (plus one for the warm start), side by side.

`run_benchmark` is the one entry point: the CLI (`scripts/benchmark_compile.py`) and the GUI's
"Benchmark…" button both call it with a config. Every cell of one call shares the machine
state and the eager baseline, so the speedups in one result are comparable with each other.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules.bench.cell import step_cap
from modules.bench.matrix import Cell, cell_config, expand_matrix
from modules.bench.timeouts import cell_timeout_seconds, denoiser_parameters
from modules.compile.bundle import BUNDLE_SUFFIX
from modules.config import Config, to_dict
from modules.model_types import MODEL_TYPES
from modules.paths import triton_cache_folder
from modules.util.errors import first_line
from modules.util.process import kill_group, last_log_line

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
POLL_SECONDS = 0.25


@dataclass(frozen=True)
class BenchProgress:
    """A progress event for a front end: which cell of how many, and what happens now."""
    index: int      # 1-based cell number
    total: int
    cell: str       # the cell's label
    phase: str      # cold | warm | done | failed
    message: str


@dataclass
class BenchmarkResult:
    """Everything one benchmark call measured; `markdown()` is the table the docs show."""
    machine: dict[str, Any]
    settings: dict[str, Any]
    cells: list[dict[str, Any]] = field(default_factory=list)

    def baseline(self) -> dict[str, Any] | None:
        return next((c for c in self.cells if c["backend"] == "NONE"), None)

    def working(self) -> list[dict[str, Any]]:
        """Compiled cells that ran their requested backend with no fallback."""
        return [c for c in self.cells if c["backend"] != "NONE" and c["status"] == "ok"
                and not c.get("fallbacks") and c.get("compiled_code_ran")
                and all(v == c["backend"] for v in c.get("effective", {}).values())]

    def fastest(self) -> dict[str, Any] | None:
        """The working compiled cell with the lowest median step time (None if none works)."""
        working = self.working()
        return min(working, key=lambda c: c["median_step_seconds"]) if working else None

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "settings": self.settings, "cells": self.cells}

    def markdown(self) -> str:
        from modules.bench.report import markdown_report
        return markdown_report(self)

    def write(self, out_dir: Path | str) -> dict[str, Path]:
        """benchmark.json, benchmark.md and benchmark.png into ``out_dir``."""
        from modules.bench.report import write_outputs
        return write_outputs(self, Path(out_dir))


ProgressFn = Callable[[BenchProgress], None]


def run_benchmark(config: Config, *, backends: Sequence[str] = ("NONE", "AOT_EAGER"),
                  components: Sequence[str] | None = None, scopes: Sequence[str] | None = None,
                  dynamic: Sequence[str] | None = None, steps: int = 5, warmup: int = 3,
                  warm_start: bool = True, cell_timeout: float | None = None,
                  out_dir: Path | str | None = None, progress: ProgressFn | None = None,
                  should_stop: Callable[[], bool] | None = None,
                  extra_settings: dict[str, Any] | None = None,
                  keep_bundles: Path | None = None) -> BenchmarkResult:
    """Benchmark ``config`` under each backend of the matrix; never raises for a failing cell.

    ``components``/``scopes``/``dynamic`` default to the config's own compile settings, so the
    GUI's short version measures the user's current setup. The median is taken over ``steps``
    clean steps: after the first ``warmup`` (at least 1: the compile), steps that compiled or
    recorded CUDA graphs are left out too (see `modules.bench.cell`). ``cell_timeout`` is the
    seconds each cell process may run; None scales it with the UNet's size and the backend
    (`modules.bench.timeouts`). ``out_dir`` keeps per-cell logs and run records (a temporary
    folder when None). ``should_stop`` is polled while cells run; when it returns True the
    running cell is killed and the rest are marked skipped. ``keep_bundles``: a folder where
    each compiled cell's compile bundles are kept (``<folder>/<cell id>/``, listed in the
    row's ``bundles``) before its cache is deleted, for a run that wants to start from the
    winner's (compile.scope AUTO); None: deleted with the cache.
    """
    if steps < 1 or warmup < 1:
        raise ValueError(f"need steps >= 1 and warmup >= 1 (the first step compiles), "
                         f"got steps={steps}, warmup={warmup}")
    from modules.bench.report import machine_info

    c = config.compile
    cells = expand_matrix(list(backends),
                          list(components) if components else [_components_of(config)],
                          list(scopes) if scopes else [c.scope.value],
                          list(dynamic) if dynamic else [c.dynamic.value])
    parameters, parameters_source = denoiser_parameters(config)
    result = BenchmarkResult(machine_info(), {
        "backends": list(backends), "steps": steps, "warmup": warmup, "warm_start": warm_start,
        "cell_timeout": cell_timeout, "unet_parameters": parameters,
        "unet_parameters_source": parameters_source, "model_path": config.model.path,
        "model_type": config.model.type.value, "resolution": config.data.resolution,
        "batch_size": config.training.batch_size, "method": config.training.method.value,
        "mixed_precision": config.training.mixed_precision.value,
        "weight_dtype": config.model.weight_dtype.value, **(extra_settings or {})})
    notify = progress or (lambda event: None)
    stop = should_stop or (lambda: False)
    with tempfile.TemporaryDirectory(prefix="tempera-bench-") as tmp:
        work = Path(out_dir) if out_dir is not None else Path(tmp)
        for index, cell in enumerate(cells, 1):
            row = _cell_row(cell)
            timeout = (cell_timeout if cell_timeout is not None else
                       cell_timeout_seconds(parameters, cell.backend, c.mode))
            row["timeout_seconds"] = timeout
            # in neutral words: each front end says how to give another limit (the CLI's
            # --cell-timeout; the window has none)
            why = ("the time per cell given" if cell_timeout is not None else
                   f"scaled for a {parameters / 1e6:.1f} M-parameter "
                   f"{MODEL_TYPES[config.model.type].denoiser_label} and {cell.backend}")
            if stop():
                row.update(status="skipped", error="benchmark stopped")
            else:
                row.update(_run_cell(config, cell, work / "cells" / cell.cell_id, steps=steps,
                                     warmup=warmup, warm_start=warm_start, timeout=(timeout, why),
                                     keep_bundles=(keep_bundles / cell.cell_id
                                                   if keep_bundles is not None else None),
                                     notify=lambda phase, msg: notify(  # called while it runs
                                         BenchProgress(index, len(cells), cell.label, phase,
                                                       msg)),
                                     stop=stop))
            result.cells.append(row)
            notify(BenchProgress(index, len(cells), cell.label,
                                 "done" if row["status"] == "ok" else "failed",
                                 row.get("error") or f"{row['median_step_seconds']:.4f} s/step"))
    if hasattr(os, "getloadavg"):
        result.machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    add_speedups(result)
    return result


def _components_of(config: Config) -> str:
    c = config.compile
    if c.vae:
        return "all"
    return "unet+te" if c.text_encoder else "unet"


def _cell_row(cell: Cell) -> dict[str, Any]:
    return {"id": cell.cell_id, "label": cell.label, "backend": cell.backend,
            "components": "-" if cell.is_baseline else cell.components,
            "scope": "-" if cell.is_baseline else cell.scope,
            "dynamic": "-" if cell.is_baseline else cell.dynamic}


def add_speedups(result: BenchmarkResult) -> None:
    """Ratios against the eager cell of the same result (None without a working baseline).

    speedup = eager median / cell median; cold_start_seconds = the cell's first step minus the
    eager median step, i.e. what turning compilation on costs before the first step is done.
    """
    base = result.baseline()
    base_median = base.get("median_step_seconds") if base and base["status"] == "ok" else None
    for row in result.cells:
        median = row.get("median_step_seconds")
        row["speedup"] = row["cold_start_seconds"] = None
        if base_median and median and row["status"] == "ok":
            row["speedup"] = round(base_median / median, 3)
            if row is not base:
                row["cold_start_seconds"] = round(row["first_step_seconds"] - base_median, 3)
        warm = row.get("warm")
        if warm and warm.get("status") == "ok" and base_median:
            warm["cold_start_seconds"] = round(warm["first_step_seconds"] - base_median, 3)


def _run_cell(base: Config, cell: Cell, folder: Path, *, steps: int, warmup: int,
              warm_start: bool, timeout: tuple[float, str], notify: Callable[[str, str], None],
              stop: Callable[[], bool], keep_bundles: Path | None = None) -> dict[str, Any]:
    """The cold run and (for compiled cells) the warm run, each in a fresh subprocess; the
    compile bundles the cold run wrote are copied to ``keep_bundles`` when it is given."""
    folder.mkdir(parents=True, exist_ok=True)
    compile_cache = folder / "compile-cache"
    if compile_cache.exists():
        shutil.rmtree(compile_cache)  # a cold start must start cold
    try:
        phases = ["cold"] + (["warm"] if warm_start and not cell.is_baseline else [])
        configs = {phase: cell_config(base, cell, max_steps=step_cap(warmup, steps),
                                      output_dir=folder / f"run-{phase}",
                                      compile_cache_dir=compile_cache) for phase in phases}
    except ValueError as err:
        return {"status": "failed", "error": first_line(err)}
    notify("cold", "cold start")
    row = run_cell_process(configs["cold"], folder, "cold", steps, warmup, timeout,
                           compile_cache, stop)
    if row["status"] == "ok" and "warm" in configs:
        notify("warm", "warm start (persistent cache)")
        warm = run_cell_process(configs["warm"], folder, "warm", steps, warmup, timeout,
                          compile_cache, stop)
        row["warm"] = {key: warm.get(key) for key in (
            "status", "error", "compile_seconds", "first_step_overhead_seconds",
            "first_step_seconds", "median_step_seconds", "cache", "recompiles")}
    if keep_bundles is not None and row["status"] == "ok":
        row["bundles"] = [str(path) for path in keep_cell_bundles(compile_cache, keep_bundles)]
    shutil.rmtree(compile_cache, ignore_errors=True)  # inductor caches are large; we made it
    return row


def keep_cell_bundles(compile_cache: Path, keep: Path) -> list[Path]:
    """Copy the compile bundles a cell's run wrote (its cache folder's ``bundles/``) into
    ``keep``; the copies, none when it wrote none (an eager cell, bundles off)."""
    written = sorted((compile_cache / "bundles").glob(f"*{BUNDLE_SUFFIX}"))
    if written:
        keep.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(path, keep / path.name)) for path in written]


def run_cell_process(config: Config, folder: Path, phase: str, steps: int, warmup: int,
               timeout: tuple[float, str], compile_cache: Path,
               stop: Callable[[], bool], *, env: dict[str, str] | None = None,
               cwd: Path = REPO_ROOT) -> dict[str, Any]:
    """One cell process: its result, with ``first_step_end_after_launch_seconds`` (the
    process's whole cold start: imports, model load, compile or bundle load, the first step).
    ``env`` is added to this process's environment; ``cwd`` is the checkout it imports from."""
    spec_path, result_path = folder / f"spec-{phase}.json", folder / f"result-{phase}.json"
    spec_path.write_text(json.dumps({"config": to_dict(config), "steps": steps,
                                     "warmup": warmup, "phase": phase}, indent=2) + "\n",
                         encoding="utf-8")
    result_path.unlink(missing_ok=True)
    # Triton keeps its own kernel cache outside inductor's folder; point it at the cell's
    # cache too, or a "cold" GPU cell would reuse the previous cell's kernels.
    child_env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache_folder(compile_cache)),
                 **(env or {})}
    command = [sys.executable, "-m", "modules.bench.cell", "--spec", str(spec_path),
               "--result", str(result_path)]
    launched = time.time()
    with open(folder / f"{phase}.log", "w", encoding="utf-8") as log:
        outcome = _wait(command, child_env, log, timeout, stop, cwd)
    run_dir = Path(config.output.dir)
    if (run_dir / "run.json").is_file():
        shutil.copyfile(run_dir / "run.json", folder / f"run-{phase}.json")
    shutil.rmtree(run_dir, ignore_errors=True)  # saved weights are not what we measure
    if outcome is not None:
        return {"status": outcome[0], "error": outcome[1]}
    if not result_path.is_file():
        return {"status": "failed", "error": last_log_line(folder / f"{phase}.log")}
    result = json.loads(result_path.read_text(encoding="utf-8"))
    result["launched_at"] = launched
    if result.get("first_step_end_time"):
        result["first_step_end_after_launch_seconds"] = round(
            result["first_step_end_time"] - launched, 3)
        result_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def _wait(command: list[str], env: dict[str, str], log, timeout: tuple[float, str],
          stop: Callable[[], bool], cwd: Path = REPO_ROOT) -> tuple[str, str] | None:
    """Run ``command``; (status, error) if it timed out or was stopped, else None.
    ``timeout`` is (seconds, where that limit came from)."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    seconds, why = timeout
    deadline = time.monotonic() + seconds
    while process.poll() is None:
        if time.monotonic() > deadline:
            kill_group(process)
            return "timeout", f"timed out after {seconds:g} s ({why})"
        if stop():
            kill_group(process)
            return "skipped", "benchmark stopped"
        time.sleep(POLL_SECONDS)
    return None
