"""One benchmark cell, run in its own process: ``python -m modules.bench.cell --spec F --result F``.

A fresh process per cell means a clean compiler state (no dynamo caches, counters or inductor
kernels left by the previous cell) and an honest peak memory. The cell drives the real trainer
(`modules.train.trainer.train`), so it measures what users run: the guarded step, the optimizer,
the data loader.

Timing: the first step is the trainer's own measurement (run.json ``first_step_seconds``, host
clock, ending at the step's loss read, which waits for the device). Each later step is the
interval between two optimizer-step ends: on CUDA two CUDA events recorded on the stream, read
after one ``torch.cuda.synchronize()`` when the run is over (no extra sync inside the measured
window); on the CPU ``time.perf_counter``.

Which steps the median leaves out is decided by what happened, not by a fixed count: the first
``warmup`` steps (at least the first, which compiles), every step during which the compile
engine reported a compile (its `CompileEvent`s, or dynamo's graph counter moving), and, when a
component runs CUDA graphs, the steps after each compile in which the new graph is warmed up and
recorded. The cell keeps training until it has ``steps`` such clean steps (or a cap is reached),
then stops the trainer. Given ``stop_at`` (a wall-clock time: its parent's time limit less a
margin to save and write), it also stops once that time has passed and it has one clean step:
a cell cut short by its limit reports the median of the clean steps it has (``partial``), since
a ratio from a short steady window beats none.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from modules.events import CompileEvent, NullCallbacks, Progress, TrainerCommands
from modules.train.outputs.record import peak_memory
from modules.util.atomic import atomic_write_text
from modules.util.errors import describe

# After a compile, a CUDA-graph tree runs the new graph without a graph first (warm-up, in the
# compile step itself), records it at the next call, and replays it from then on. So the step
# after a compile records; one more is left out as margin (a backward graph may be recorded a
# call after its forward). Not yet checked on a GPU: each cell's JSON keeps every step's
# seconds and the compile steps, so the first GPU run can confirm the count.
CUDAGRAPH_SETTLE_STEPS = 2
KEPT_EVENT_KINDS = ("fallback", "degraded", "recompile", "warning")
PROGRESS_EVERY_SECONDS = 2.0
# What a cell stopping itself at its time limit keeps for after the stop request: the step in
# flight, the trainer's final save and record, the result file (the step of a large model with
# gradient checkpointing takes seconds; a LoRA's save one).
STOP_MARGIN_SECONDS = 30.0


def stop_time(limit_seconds: float, margin: float = STOP_MARGIN_SECONDS) -> float:
    """The ``stop_at`` (wall clock) of a cell that starts now and is killed after
    ``limit_seconds``: early enough to end by itself with the clean steps it has."""
    return time.time() + limit_seconds - margin


def step_cap(warmup: int, steps: int) -> int:
    """The most steps a cell trains while it looks for ``steps`` clean ones: room for a few
    later compiles (a fallback, a recompile) without training forever if every step compiles."""
    return warmup + 2 * steps + CUDAGRAPH_SETTLE_STEPS


def _dynamo_counter(group: str, key: str | None = None) -> int:
    from torch._dynamo.utils import counters

    if key is None:
        return sum(counters[group].values())
    return counters[group][key]


def excluded_steps(count: int, warmup: int, compile_steps: Iterable[int],
                   settle_steps: int) -> set[int]:
    """0-based steps the median leaves out: the first ``warmup``, each step that compiled, and
    the ``settle_steps`` after it (CUDA-graph warm-up and recording)."""
    excluded = set(range(min(warmup, count)))
    for step in compile_steps:
        excluded.update(range(step, min(count, step + 1 + settle_steps)))
    return excluded


class StepTimer(NullCallbacks):
    """Trainer callbacks that timestamp each optimizer step and note the steps that compiled.

    ``steps``/``warmup``/``settle_steps`` set when enough clean steps were seen: the timer then
    asks ``commands`` to stop the run (the trainer looks at the start of the next step). So it
    does once ``stop_at`` (``time.time()``) has passed and one clean step was seen
    (``cut_short``).
    """

    def __init__(self, cuda: bool, *, steps: int | None = None, warmup: int = 1,
                 settle_steps: int = 0, commands: TrainerCommands | None = None,
                 progress: Path | None = None, stop_at: float | None = None) -> None:
        self.cuda = cuda
        self.wanted, self.warmup, self.settle_steps = steps, warmup, settle_steps
        self.commands = commands
        self.stop_at = stop_at
        self.cut_short = False
        self.progress = progress     # where the step and the last compile status go, if set
        self.compile_status = ""
        self.progress_written = -math.inf
        self.stamps: list[float] = []        # perf_counter at each step's end
        self.first_step_end: float | None = None  # time.time() there: a parent compares it
        self.cuda_events: list[Any] = []     # torch.cuda.Event at each step's end (CUDA)
        self.graphs: list[int] = []          # dynamo's unique_graphs after each step
        self.compile_steps: set[int] = set()
        self.compile_events: list[dict[str, Any]] = []

    @property
    def step_in_flight(self) -> int:
        return len(self.stamps)

    def on_compile(self, event: CompileEvent) -> None:
        # Every compile the engine sees emits an event inside the call that compiled (progress
        # while it compiles, done, a fallback's recompile...); events from apply() precede
        # step 0, which is never timed anyway.
        self.compile_steps.add(self.step_in_flight)
        if event.kind in KEPT_EVENT_KINDS:
            self.compile_events.append({"step": self.step_in_flight + 1,
                                        "component": event.component, "kind": event.kind,
                                        "message": event.message})
        self.compile_status = f"{event.component} {event.kind}: {event.message}"[:120]
        self._write_progress()

    def _write_progress(self, every: float = 0.0) -> None:
        """What a cell killed at its limit has done: steps ended, the last compile status (at
        most once per ``every`` seconds: a write is host time inside a timed step)."""
        now = time.monotonic()
        if self.progress is None or now - self.progress_written < every:
            return
        self.progress_written = now
        atomic_write_text(self.progress, json.dumps({
            "step": self.step_in_flight, "compile": self.compile_status,
            "compile_steps": sorted(s + 1 for s in self.compile_steps),
            "updated_at": time.time()}) + "\n")

    def on_progress(self, progress: Progress) -> None:
        step = self.step_in_flight
        if self.cuda:
            import torch
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.cuda_events.append(event)
        self.stamps.append(time.perf_counter())
        if self.first_step_end is None:
            self.first_step_end = time.time()
        graphs = _dynamo_counter("stats", "unique_graphs")
        if graphs != (self.graphs[-1] if self.graphs else 0):
            self.compile_steps.add(step)  # a graph no engine event announced
        self.graphs.append(graphs)
        self._write_progress(every=PROGRESS_EVERY_SECONDS)
        if self.commands is None:
            return
        timed = len(self.timed_steps(self.settle_steps))
        if self.wanted is not None and timed >= self.wanted:
            self.commands.request_stop()
        elif self.stop_at is not None and timed and time.time() >= self.stop_at:
            self.cut_short = True
            self.commands.request_stop()

    def timed_steps(self, settle_steps: int) -> list[int]:
        skip = excluded_steps(len(self.stamps), self.warmup, self.compile_steps, settle_steps)
        return [i for i in range(len(self.stamps)) if i not in skip]

    def step_seconds(self, first_step: float) -> list[float]:
        """Every step's seconds; call after the run (on CUDA it synchronizes once, here)."""
        if self.cuda and self.cuda_events:
            import torch
            torch.cuda.synchronize()
            later = [a.elapsed_time(b) / 1000.0
                     for a, b in zip(self.cuda_events, self.cuda_events[1:])]
        else:
            later = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        return [first_step] + later


def may_use_cudagraphs(config: Any, cuda: bool) -> bool:
    """Whether the run's compile plan keeps CUDA graphs on for a component: the plan training
    applies (`compile_plans`; run.json says after the run). Used only to decide when enough steps
    were seen."""
    from modules.train.recipe.compile_guard import compile_plans

    return cuda and any(plan.cudagraphs for plan in compile_plans(config).values())


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
        "bundle": "/".join(sorted({r.get("bundle", "off") for r in compiled.values()})) or "off",
        "compiled_code_ran": all(r["compiled_code_ran"] for name, r in compiled.items()
                                 if r["effective"] != "NONE"),
    }


def run_cell(spec: dict[str, Any]) -> dict[str, Any]:
    """Train until ``steps`` clean steps were timed (see the module doc); the cell's numbers."""
    import torch

    from modules.config import from_dict
    from modules.train.trainer import train

    config = from_dict(spec["config"])
    warmup, steps = spec["warmup"], spec["steps"]
    cuda = torch.cuda.is_available() and config.general.device.value != "CPU"
    commands = TrainerCommands()
    timer = StepTimer(cuda, steps=steps, warmup=warmup, commands=commands,
                      settle_steps=CUDAGRAPH_SETTLE_STEPS if may_use_cudagraphs(config, cuda)
                      else 0, progress=Path(spec["progress"]) if spec.get("progress") else None,
                      stop_at=spec.get("stop_at"))
    started = time.perf_counter()
    result = train(config, timer, commands)
    wall = time.perf_counter() - started
    record = json.loads((result.output_dir / "run.json").read_text(encoding="utf-8"))
    step_seconds = timer.step_seconds(record["first_step_seconds"])
    cudagraphs = any(r.get("cudagraphs") for r in record["compile"].values()
                     if r["effective"] != "NONE")
    timed = timer.timed_steps(CUDAGRAPH_SETTLE_STEPS if cudagraphs else 0)
    if not timed:
        compiled = sorted(s + 1 for s in timer.compile_steps)
        raise RuntimeError(f"no clean step to time: all {len(step_seconds)} steps were warm-up "
                           f"or compiled (compiles in steps {compiled})")
    median = statistics.median(step_seconds[i] for i in timed)
    graphs_after_warmup = timer.graphs[-1] - timer.graphs[warmup - 1] if warmup else None
    return {
        "status": "ok",
        "timing": "cuda_events" if cuda else "perf_counter",
        "steps_run": len(step_seconds),
        "step_seconds": [round(s, 5) for s in step_seconds],
        "timed_steps": [i + 1 for i in timed],          # 1-based, as the trainer counts
        "steps_wanted": steps,
        "partial": len(timed) < steps,                   # fewer clean steps than asked for
        "stopped_at_time_limit": timer.cut_short,
        "compile_steps": sorted(s + 1 for s in timer.compile_steps if s < len(step_seconds)),
        "cudagraphs": cudagraphs,
        "median_step_seconds": round(median, 5),
        "first_step_seconds": round(step_seconds[0], 4),
        "first_step_overhead_seconds": round(step_seconds[0] - median, 4),
        "first_step_end_time": timer.first_step_end,
        **peak_memory(cuda),
        "graph_breaks": _dynamo_counter("graph_break"),
        "unique_graphs": _dynamo_counter("stats", "unique_graphs"),
        "graphs_after_warmup": graphs_after_warmup,
        "compile_events": timer.compile_events,
        "run_wall_seconds": round(wall, 3),
        "device": record.get("device"),
        **summarize_compile(record["compile"]),
    }


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
        result = {"status": "failed", "error": describe(err)}
        code = 1
    Path(args.result).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return code


if __name__ == "__main__":
    sys.exit(main())
