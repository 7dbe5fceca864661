"""One benchmark cell, run in its own process: ``python -m modules.bench.cell --spec F --result F``.

A fresh process per cell means a clean compiler state (no dynamo caches, counters or inductor
kernels left by the previous cell) and an honest peak memory. The cell drives the real trainer
(`modules.train.trainer.train`), so it measures what users run: the guarded step, the optimizer,
the data loader.

Timing: the trainer measures the first step itself (run.json ``first_step_seconds``); each later
step is the interval between two progress events, taken after ``torch.cuda.synchronize()`` on a
GPU (the trainer's ``loss.item()`` syncs too; the explicit sync keeps it honest if that changes).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from modules.events import CompileEvent, NullCallbacks, Progress


def _dynamo_counter(group: str, key: str | None = None) -> int:
    from torch._dynamo.utils import counters

    if key is None:
        return sum(counters[group].values())
    return counters[group][key]


class StepTimer(NullCallbacks):
    """Trainer callbacks that timestamp each optimizer step and count graphs per step."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.stamps: list[float] = []
        self.graphs: list[int] = []  # dynamo's unique_graphs after each step
        self.compile_events: list[dict[str, Any]] = []

    def on_progress(self, progress: Progress) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        self.graphs.append(_dynamo_counter("stats", "unique_graphs"))

    def on_compile(self, event: CompileEvent) -> None:
        if event.kind in ("fallback", "degraded", "recompile", "warning"):
            self.compile_events.append({"component": event.component, "kind": event.kind,
                                        "message": event.message})

    def step_seconds(self, first_step: float) -> list[float]:
        return [first_step] + [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def peak_memory(cuda: bool) -> tuple[int, str]:
    """(bytes, what was measured): CUDA max allocated on a GPU, else this process's peak RSS."""
    if cuda:
        import torch
        return int(torch.cuda.max_memory_allocated()), "cuda_max_allocated"
    # ru_maxrss is KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, "peak_rss"


def summarize_compile(report: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The run record's per-component compile report folded into the benchmark's columns."""
    compiled = {name: r for name, r in report.items() if r["requested"] != "NONE"}
    caches = sorted({r["cache"] for r in compiled.values()})
    return {
        "compile_seconds": round(sum(r["compile_seconds"] for r in compiled.values()), 3),
        "recompiles": sum(r["recompiles"] for r in compiled.values()),
        "fallbacks": [f"{name}: {f['from']} -> {f['to']} ({f['reason']})"
                      for name, r in compiled.items() for f in r["fallbacks"]],
        "degraded": [f"{name}: {r['degraded']}" for name, r in compiled.items() if r["degraded"]],
        "effective": {name: r["effective"] for name, r in compiled.items()},
        "cache": "/".join(caches) if caches else "off",
        "compiled_code_ran": all(r["compiled_code_ran"] for name, r in compiled.items()
                                 if r["effective"] != "NONE"),
    }


def run_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """Train ``warmup + steps`` steps with the spec's config and return the cell's numbers."""
    import torch

    from modules.config import from_dict
    from modules.train.trainer import train

    config = from_dict(spec["config"])
    warmup, steps = spec["warmup"], spec["steps"]
    cuda = torch.cuda.is_available() and config.general.device.value != "CPU"
    timer = StepTimer(cuda)
    started = time.perf_counter()
    result = train(config, timer)
    wall = time.perf_counter() - started
    record = json.loads((result.output_dir / "run.json").read_text(encoding="utf-8"))
    step_seconds = timer.step_seconds(record["first_step_seconds"])
    timed = step_seconds[warmup:]
    if not timed:
        raise RuntimeError(f"the run stopped after {len(step_seconds)} steps; "
                           f"{warmup} warm-up + {steps} timed steps were asked for")
    median = statistics.median(timed)
    memory, memory_kind = peak_memory(cuda)
    graphs_after_warmup = timer.graphs[-1] - timer.graphs[warmup - 1] if warmup else None
    return {
        "status": "ok",
        "steps_run": len(step_seconds),
        "step_seconds": [round(s, 5) for s in step_seconds],
        "median_step_seconds": round(median, 5),
        "first_step_seconds": round(step_seconds[0], 4),
        "first_step_overhead_seconds": round(step_seconds[0] - median, 4),
        "peak_memory_bytes": memory,
        "peak_memory_kind": memory_kind,
        "graph_breaks": _dynamo_counter("graph_break"),
        "unique_graphs": _dynamo_counter("stats", "unique_graphs"),
        "graphs_after_warmup": graphs_after_warmup,
        "compile_events": timer.compile_events,
        "run_wall_seconds": round(wall, 3),
        "device": record.get("device"),
        **summarize_compile(record["compile"]),
    }


def first_error_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one compile benchmark cell.")
    parser.add_argument("--spec", required=True, help="JSON file with config, warmup, steps")
    parser.add_argument("--result", required=True, help="where to write the result JSON")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text(encoding="utf-8"))
    try:
        result = run_cell(spec)
        code = 0
    except Exception as err:  # the cell's failure is its result: the parent records the row
        traceback.print_exc()
        result = {"status": "failed", "error": first_error_line(err)}
        code = 1
    Path(args.result).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return code


if __name__ == "__main__":
    sys.exit(main())
