"""GPU validation: one phase per command on a GPU machine that is lent rarely and briefly.

``scripts/gpu_validate.py PHASE`` runs one phase of `modules.bench.gpu_phases.PHASES`: a list of
jobs, each in its own process under its own time limit, all inside the phase's budget (default
9 minutes: the lending machine kills a command at 10). A job that runs out of time is a result
("INDUCTOR REGIONAL > 240 s cold at SD 1.5" is a finding), and a job the budget has no room
left for is recorded as not started. After every job the results so far are written to the
output folder, so a command killed from outside still returns what it measured:

    summary.md / summary.json   every job's row (the table is also printed last)
    runs.tar.gz                 each job's run.json, benchmark JSON, progress and log tail

Three files (`modules.bench.gpu_outputs` writes them), well inside the 8 the lending machine
gives back. A phase needs nothing from an earlier one: each lent session starts a bare
machine. ``--device cpu --tiny`` runs the same jobs on the tiny built-in models (the CPU suite
rehearses every phase this way).

Nothing outlives the phase: the jobs run in their own process sessions (so a job is killed
whole, compile workers included), and the runner kills every one still running when it ends
in any way: in a ``finally``, on SIGTERM or SIGINT (recorded as ``stopped`` rows), and, on
Linux, by the kernel when the runner itself is SIGKILLed (`dies_with_parent`). The parent
never touches CUDA: the GPU's name is read by the env job that starts every phase.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules.bench.gpu_context import Context
from modules.bench.gpu_machine import card_memory
from modules.bench.gpu_packages import missing, wheels_command
from modules.bench.gpu_outputs import log_tail, write_outputs
from modules.util.cores import usable_cores
from modules.util.process import (
    dies_with_parent,
    kill_group,
    last_log_line,
    with_repo_on_pythonpath,
)

REPO = Path(__file__).resolve().parents[2]
PACK_RESERVE_SECONDS = 25    # kept back from the budget to write the outputs at the end
MIN_JOB_SECONDS = 15         # a job with less time left than this is not started
POLL_SECONDS = 0.2
REST = math.inf              # a job's limit_s: whatever the phase's budget has left
OUT_OF_MEMORY = re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)


@dataclass(frozen=True)
class Job:
    """One measured thing. ``kind`` picks its handler in `KINDS`; ``spec`` is the kind's data.

    ``group``: jobs of one group run side by side (at most ``Context.parallel`` at once) and
    are recorded as such. ``after``: jobs that must have ended "ok" first (else: not started).
    ``limit_s``: its own time limit at full size (`REST`: what the budget has left); the
    phase's remaining budget cuts it, less ``reserve_s`` kept for the jobs that follow the
    runs of its group (their LoRA checks): a job that would leave them less is not started.
    """
    name: str
    kind: str
    limit_s: float
    spec: dict[str, Any] = field(default_factory=dict)
    group: str | None = None
    after: tuple[str, ...] = ()
    answers: str = ""
    reserve_s: float = 0.0


@dataclass(frozen=True)
class Kind:
    """How a kind of job runs: the command of its process (given the job with the limit it
    got), and the row read from its files. ``interrupt_s``: at its limit the job first gets
    SIGINT, and this long to write its results (pytest's junit file), before SIGKILL."""
    command: Callable[[Job, Context, Path], list[str]]
    collect: Callable[[Job, Context, Path], dict[str, Any]]
    interrupt_s: float = 0.0


class PhaseStopped(Exception):
    """The runner got SIGTERM or SIGINT: the jobs are killed, the results so far written."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"the runner got {signal.Signals(signum).name}")
        self.signum = signum


def python() -> str:
    return sys.executable


def child_env(threads: int) -> dict[str, str]:
    """The jobs' environment: offline, unbuffered, a bounded compile thread count, and this
    checkout on PYTHONPATH *in front of* what is there (the GPU image keeps diffusers in .site/
    on PYTHONPATH: replacing it would lose it)."""
    return {**with_repo_on_pythonpath(repo=REPO), "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, threads))}


def compile_threads(parallel: int) -> int:
    """Compile workers per job: the cores shared among the jobs that compile side by side."""
    return max(1, usable_cores() // max(1, parallel))


def has_xdist() -> bool:
    return importlib.util.find_spec("xdist") is not None


# --- running -------------------------------------------------------------------------------
def run_phase(ctx: Context, jobs: list[Job], kinds: dict[str, Kind],
              print_line: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run ``jobs`` in their order: a job without a group runs alone; jobs of one group run
    side by side (at most ``ctx.parallel``), each starting once the jobs it needs have ended.
    The outputs are written again after every job. However the phase ends, no job outlives
    it; on SIGTERM/SIGINT the rows say so and `PhaseStopped` is raised after the outputs."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.work.mkdir(parents=True, exist_ok=True)
    # An earlier run of this phase on this machine (a rerun with a smaller --budget) left its
    # jobs' folders: the archive must hold this run's only. Models and caches stay.
    if ctx.jobs_root().exists():
        shutil.rmtree(ctx.jobs_root())
    ctx.order = [job.name for job in jobs]
    ctx.machine()  # its date and load average as the phase starts, not after its first job
    waiting: list[Job] = list(jobs)
    running: list[_Running] = []
    with _stop_on_signals():  # inside it, a second signal does not cut the cleanup short
        try:
            while waiting or running:
                if _start_next(waiting, running, ctx, kinds, print_line):
                    continue
                _end_finished(running, ctx, kinds, print_line)
                if running:
                    time.sleep(POLL_SECONDS)
        except BaseException as err:
            why = str(err) if isinstance(err, PhaseStopped) else \
                f"the runner failed: {type(err).__name__}: {err}"
            _abandon(ctx, running, waiting, kinds, why, print_line)
            raise
        finally:
            for item in running:  # only after an exception: every ended job was removed
                kill_group(item.process)
    write_outputs(ctx, final=True)
    return ctx.rows


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT raise `PhaseStopped` in the loop (once: cleaning up is not
    interrupted again), so the caller's cleanup runs; the handlers before are put back."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    seen: list[int] = []

    def stop(signum: int, frame: Any) -> None:
        if not seen:
            seen.append(signum)
            raise PhaseStopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _abandon(ctx: Context, running: list["_Running"], waiting: list[Job],
             kinds: dict[str, Kind], why: str, print_line: Callable[[str], None]) -> None:
    """The phase ends early: kill what runs (a `stopped` row each, with what it wrote), the
    rest is not started; the outputs are written as they stand."""
    for item in list(running):
        kill_group(item.process)
        running.remove(item)
        try:
            row = _finish(item, ctx, kinds[item.job.kind], timed_out=False, stopped=why)
        except Exception as err:  # noqa: BLE001 - ending anyway: the row says what failed
            row = _row(item.job, "stopped", time.monotonic() - item.started,
                       error=f"{why}; its files were not read: {type(err).__name__}: {err}")
        ctx.rows.append(row)
        print_line(f"[{row['job']}] stopped after {row['seconds']:.0f} s: {why}")
    for job in waiting:
        ctx.rows.append(_row(job, "not started", 0.0, error=why))
    waiting.clear()
    write_outputs(ctx, final=False)


def _start_next(waiting: list[Job], running: list["_Running"], ctx: Context,
                kinds: dict[str, Kind], print_line: Callable[[str], None]) -> bool:
    """Start (or record as not started) the next job that may start now; False: none may."""
    job = _next_startable(waiting, running, ctx)
    if job is None:
        return False
    waiting.remove(job)
    why = _why_not_started(job, ctx)
    if why:
        _record(ctx, _row(job, "not started", 0.0, error=why), print_line, why)
        return True
    try:
        running.append(_start(job, ctx, kinds[job.kind]))
    except Exception as err:  # noqa: BLE001 - a job that cannot start is its row
        error = f"could not start: {type(err).__name__}: {err}"
        _record(ctx, _row(job, "failed", 0.0, error=error), print_line, error)
        return True
    print_line(f"[{job.name}] started, limit {running[-1].limit:.0f} s"
               + (f", side by side with {len(running) - 1}" if len(running) > 1 else ""))
    return True


def _end_finished(running: list["_Running"], ctx: Context, kinds: dict[str, Kind],
                  print_line: Callable[[str], None]) -> None:
    """Record every job that ended or reached its limit (interrupting, then killing, it)."""
    for item in running:
        item.side_by_side = max(item.side_by_side, len(running))
    now = time.monotonic()
    for item in list(running):
        kind = kinds[item.job.kind]
        if item.process.poll() is None:
            if now < item.deadline:
                continue
            if kind.interrupt_s and item.interrupted is None:
                _interrupt(item, now)   # SIGINT: it writes what it has, then exits
                continue
            if item.interrupted is not None and now < item.interrupted + kind.interrupt_s:
                continue
            item.timed_out = True
        kill_group(item.process)  # what it started dies with it, even when it ended itself
        running.remove(item)
        row = _finish(item, ctx, kind, item.timed_out or item.interrupted is not None)
        _record(ctx, row, print_line, row.get("error"))


def _interrupt(item: "_Running", now: float) -> None:
    item.interrupted = now
    try:
        os.kill(item.process.pid, signal.SIGINT)   # the job's leader only: it stops its own
    except ProcessLookupError:
        pass


def _record(ctx: Context, row: dict[str, Any], print_line: Callable[[str], None],
            detail: str | None) -> None:
    ctx.rows.append(row)
    print_line(f"[{row['job']}] {row['status']}"
               + (f" in {row['seconds']:.0f} s" if row["status"] != "not started" else "")
               + (f": {detail}" if detail else ""))
    write_outputs(ctx, final=False)


def _next_startable(waiting: list[Job], running: list["_Running"], ctx: Context) -> Job | None:
    """The first waiting job that may start now, in the phase's order: a job alone waits for
    every running job, a group's job for a free slot and for the jobs it needs. A job that
    can never start (what it needs failed) is returned too: the caller records why."""
    pending = {j.name for j in waiting} | {r.job.name for r in running}
    for job in waiting:
        blocked_by_need = any(name in pending for name in job.after)
        if job.group is None:
            if not running and not blocked_by_need:
                return job
            return None  # nothing listed after a lone job overtakes it
        if running and any(r.job.group != job.group for r in running):
            return None
        if blocked_by_need or len(running) >= ctx.parallel:
            continue
        return job
    if not running and waiting:  # only jobs waiting on each other: let the first report it
        return waiting[0]
    return None


def _why_not_started(job: Job, ctx: Context) -> str:
    backend = job.spec.get("backend")
    if job.spec.get("needs_cuda") and ctx.device != "cuda":
        return "needs a CUDA GPU"
    if ctx.jobs is not None and job.name not in ctx.jobs:
        return "not in --jobs"
    if ctx.backends is not None and backend and backend not in ctx.backends:
        return f"backend {backend} not in --backends {','.join(ctx.backends)}"
    absent = missing(job.spec.get("packages", ()))
    if absent:
        return (f"needs {', '.join(absent)}, not installed here: carry the wheel "
                f"({wheels_command(absent)})")
    for name in job.after:
        before = ctx.row(name)
        if before is None or before["status"] != "ok":
            return f"needs {name}, which " + ("did not run" if before is None else
                                             f"ended {before['status']}")
    if ctx.remaining() - PACK_RESERVE_SECONDS - job.reserve_s < MIN_JOB_SECONDS:
        return (f"the phase's budget is spent ({ctx.remaining():.0f} s left of "
                f"{ctx.budget_s:.0f}" + (f", {job.reserve_s:.0f} s of it kept for the checks "
                                         "after the runs" if job.reserve_s else "") + ")")
    return ""


def job_limit(job: Job, remaining: float) -> float:
    """The seconds ``job`` may run with ``remaining`` seconds of budget left: its own limit,
    cut to the budget less the packing reserve and less its reserve for the jobs that follow
    the runs of its group (their LoRA checks: kept even when the group runs one at a time)."""
    return min(job.limit_s, remaining - PACK_RESERVE_SECONDS - job.reserve_s)


@dataclass
class _Running:
    job: Job
    folder: Path
    process: subprocess.Popen
    started: float
    deadline: float
    limit: float
    side_by_side: int = 1    # the most jobs that ran at once while this one ran
    interrupted: float | None = None   # when it got SIGINT at its limit
    timed_out: bool = False


def _start(job: Job, ctx: Context, kind: Kind) -> _Running:
    folder = ctx.job_dir(job.name)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    limit = job_limit(job, ctx.remaining())
    command = kind.command(dataclasses.replace(job, limit_s=limit), ctx, folder)
    (folder / "command.json").write_text(json.dumps(command) + "\n", encoding="utf-8")
    threads = compile_threads(ctx.parallel if job.group else 1)
    with open(folder / "log.txt", "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, cwd=REPO, env=child_env(threads), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=dies_with_parent())
    now = time.monotonic()
    # A job that is interrupted first gets its SIGINT early enough to be killed at its limit.
    return _Running(job, folder, process, now, now + max(1.0, limit - kind.interrupt_s), limit)


def _finish(item: _Running, ctx: Context, kind: Kind, timed_out: bool,
            stopped: str = "") -> dict[str, Any]:
    seconds = time.monotonic() - item.started
    extra: dict[str, Any] = {"side_by_side": item.side_by_side}
    try:
        extra.update(kind.collect(item.job, ctx, item.folder))
    except (OSError, ValueError, KeyError) as err:  # no result file: the log tail says why
        extra.setdefault("collect_error", f"{type(err).__name__}: {err}")
    error: str | None
    if timed_out or stopped:
        status = "stopped" if stopped else "timeout"
        error = (f"{stopped}: killed after {seconds:.0f} s" if stopped else
                 f"{item.job.name} > {item.limit:.0f} s ("
                 + ("interrupted" if item.interrupted is not None else "killed")
                 + " at its time limit)")
        extra.pop("status", None)
        extra.pop("error", None)
    else:  # the job's own files say how it ended; without them, its exit code
        code = item.process.returncode
        status = extra.pop("status", None) or ("ok" if code == 0 else "failed")
        if item.job.kind == "train" and code == 2 and status == "failed":
            status = "refused"  # train.py's check phase refused it (a ConfigError): an answer
        error = extra.pop("error", None)
        if status != "ok" and not error:  # a crash's cause is in its log, not the missing file
            error = (last_log_line(item.folder / "log.txt") if code else None) or \
                extra.get("collect_error")
    if status not in ("ok", "refused") and OUT_OF_MEMORY.search(
            f"{error}\n{log_tail(item.folder / 'log.txt')}"):
        extra["card_memory"] = card_memory()  # a neighbour's use may be why, not the backend
    return _row(item.job, status, seconds, error=error, exit_code=item.process.returncode,
                **extra)


def _row(job: Job, status: str, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"job": job.name, "kind": job.kind, "status": status, "seconds": round(seconds, 1),
            "answers": job.answers, **{k: v for k, v in job.spec.items()
                                       if k in ("backend", "model", "compare_with",
                                                "warm_from")},
            **{k: v for k, v in extra.items() if v is not None}}
