"""The measurement behind ``compile.scope=AUTO``, as a process of its own:
``python -m modules.bench.scope_measure --config RUN.json --allowed REGIONAL,FULL --out M.json
[--bundles DIR]``.

The run (`modules.train.recipe.compile_scope`) starts it rather than importing the benchmark
(the trainer sits below the benchmark, which trains). One eager cell and one per allowed
compiled scope, each a fresh process, a few steps each (`run_benchmark`); the output is, per
candidate ("eager" or the scope), its median steady step and first step, or null for a cell
that failed, timed out or fell back to another backend. With ``--bundles DIR``, the compile
bundles each measured compiled candidate's cell wrote are kept in ``DIR/<candidate>/``: the run
that asked adopts the winner's, so it does not compile again what its measurement compiled.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

# Short: the benchmark's first step compiles (cold); three clean steps give a median.
MEASURE_STEPS = 3
MEASURE_WARMUP = 1
EAGER = "NONE"


def measure_scopes(config: Any, allowed: list[str], keep_bundles: Path | None = None
                   ) -> dict[str, dict[str, Any] | None]:
    """``config`` (scope REGIONAL, as the benchmark's base) measured eager and under each
    allowed compiled scope; per candidate ``{"step_seconds", "first_step_seconds"}`` or None.
    ``keep_bundles``: where each measured candidate's compile bundles are kept, in a folder
    named for it (None: deleted with the cells' caches)."""
    from modules.bench.runner import _components_of, run_benchmark

    scopes = [s for s in allowed if s != EAGER]
    result = run_benchmark(config, backends=[EAGER, config.compile.backend.value],
                           components=[_components_of(config)], scopes=scopes,
                           steps=MEASURE_STEPS, warmup=MEASURE_WARMUP, warm_start=False,
                           keep_bundles=keep_bundles / "cells" if keep_bundles else None)
    working = {id(c) for c in result.working()}
    measured: dict[str, dict[str, Any] | None] = {}
    for cell in result.cells:
        name = EAGER if cell["backend"] == EAGER else cell["scope"]
        ok = cell["status"] == "ok" and (name == EAGER or id(cell) in working)
        measured[name] = ({"step_seconds": cell["median_step_seconds"],
                           "first_step_seconds": cell["first_step_seconds"]} if ok else None)
        if ok and keep_bundles is not None and cell.get("bundles"):
            (keep_bundles / name).mkdir(parents=True, exist_ok=True)
            for path in map(Path, cell["bundles"]):
                path.replace(keep_bundles / name / path.name)
    if keep_bundles is not None:
        shutil.rmtree(keep_bundles / "cells", ignore_errors=True)  # the failed cells' bundles
    return measured


def main(argv: list[str] | None = None) -> int:
    from modules.config import load_config

    parser = argparse.ArgumentParser(description="Measure the compile scopes AUTO picks from.")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--allowed", required=True, help="comma-separated candidates")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bundles", type=Path, default=None,
                        help="keep each compiled cell's compile bundles in this folder")
    args = parser.parse_args(argv)
    measured = measure_scopes(load_config(args.config), args.allowed.split(","), args.bundles)
    args.out.write_text(json.dumps(measured, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
