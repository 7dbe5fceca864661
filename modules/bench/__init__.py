"""The compile benchmark: every backend side by side, one clean subprocess per cell.

`run_benchmark(config, backends=..., steps=..., progress=...)` returns a `BenchmarkResult`
(``.markdown()``, ``.write(out_dir)``, ``.fastest()``); `apply_fastest` writes the winner into a
preset. ``scripts/benchmark_compile.py`` is the command line. See docs/benchmarks.md.
"""
from modules.bench.apply import ApplyError, apply_fastest, is_builtin_preset
from modules.bench.runner import BenchmarkResult, BenchProgress, run_benchmark

__all__ = ["ApplyError", "BenchProgress", "BenchmarkResult", "apply_fastest",
           "is_builtin_preset", "run_benchmark"]
