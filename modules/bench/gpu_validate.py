"""GPU validation: one phase per command on a GPU machine that is lent rarely and briefly.

``scripts/gpu_validate.py PHASE`` runs one phase of `modules.bench.gpu_phases.PHASES`: a list of
jobs, each in its own process under its own time limit, all inside the phase's budget (default
9 minutes: the lending machine kills a command at 10). A job that runs out of time is a result
("INDUCTOR REGIONAL > 240 s cold at SD 1.5" is a finding), and a job the budget has no room
left for is recorded as not started. After every job the results so far are written to the
output folder, so a command killed from outside still returns what it measured:

    summary.md / summary.json   every job's row (the table is also printed last)
    runs.tar.gz                 each job's run.json, benchmark JSON and log tail

Three files, well inside the 8 the lending machine gives back. A phase needs nothing from an
earlier one: each lent session starts a bare machine. ``--device cpu --tiny`` runs the
same jobs on the tiny built-in models (the CPU suite rehearses every phase this way).
"""
from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules.util.process import kill_group, last_log_line, with_repo_on_pythonpath

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20
PACK_RESERVE_SECONDS = 25    # kept back from the budget to write the outputs at the end
MIN_JOB_SECONDS = 15         # a job with less time left than this is not started
LOG_TAIL_LINES = 60
POLL_SECONDS = 0.2


@dataclass(frozen=True)
class Job:
    """One measured thing. ``kind`` picks its handler in `KINDS`; ``spec`` is the kind's data.

    ``group``: jobs of one group run side by side (at most ``Context.parallel`` at once) and
    are recorded as such. ``after``: jobs that must have ended "ok" first (else: not started).
    ``limit_s``: its own time limit at full size; the phase's remaining budget may cut it.
    """
    name: str
    kind: str
    limit_s: float
    spec: dict[str, Any] = field(default_factory=dict)
    group: str | None = None
    after: tuple[str, ...] = ()
    answers: str = ""


@dataclass
class Context:
    """Where a phase runs and what its jobs have found so far."""
    phase: str
    device: str                      # "cuda" | "cpu"
    tiny: bool
    out: Path                        # what comes back ($OUT)
    work: Path                       # models, runs and caches; kept on a warm machine
    budget_s: float
    parallel: int
    backends: tuple[str, ...] | None = None   # only jobs of these backends (None: all)
    jobs: tuple[str, ...] | None = None       # only these jobs, by name (None: all)
    started: float = field(default_factory=time.monotonic)
    rows: list[dict[str, Any]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)   # job names, as the phase lists them

    def remaining(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def row(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.rows if r["job"] == name), None)

    def job_dir(self, name: str) -> Path:
        return self.work / "jobs" / self.phase / name

    def compile_cache(self) -> Path:
        """The compile caches of a machine's phases: each job has its own subfolder (a cold
        start must not find another backend's); a warm cell starts from its cold one's."""
        return self.work / "compile-cache"


@dataclass(frozen=True)
class Kind:
    """How a kind of job runs: the command of its process, and the row read from its files."""
    command: Callable[[Job, Context, Path], list[str]]
    collect: Callable[[Job, Context, Path], dict[str, Any]]


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
    return max(1, (os.cpu_count() or 1) // max(1, parallel))


def has_xdist() -> bool:
    return importlib.util.find_spec("xdist") is not None


# --- running -------------------------------------------------------------------------------
def run_phase(ctx: Context, jobs: list[Job], kinds: dict[str, Kind],
                print_line: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run ``jobs`` in their order: a job without a group runs alone; jobs of one group run
    side by side (at most ``ctx.parallel``), each starting once the jobs it needs have ended.
    The outputs are written again after every job."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.work.mkdir(parents=True, exist_ok=True)
    ctx.order = [job.name for job in jobs]
    waiting: list[Job] = list(jobs)
    running: list[_Running] = []
    while waiting or running:
        job = _next_startable(waiting, running, ctx)
        if job is not None:
            waiting.remove(job)
            why = _why_not_started(job, ctx)
            if why:
                _record(ctx, _row(job, "not started", 0.0, error=why), print_line, why)
                continue
            try:
                running.append(_start(job, ctx, kinds[job.kind]))
            except Exception as err:  # noqa: BLE001 - a job that cannot start is its row
                error = f"could not start: {type(err).__name__}: {err}"
                _record(ctx, _row(job, "failed", 0.0, error=error), print_line, error)
                continue
            print_line(f"[{job.name}] started, limit {running[-1].limit:.0f} s"
                       + (f", side by side with {len(running) - 1}" if len(running) > 1 else ""))
            continue
        for item in running:
            item.side_by_side = max(item.side_by_side, len(running))
        for item in [r for r in running if r.process.poll() is not None
                     or time.monotonic() >= r.deadline]:
            running.remove(item)
            timed_out = item.process.poll() is None
            if timed_out:
                kill_group(item.process)
            row = _finish(item, ctx, kinds[item.job.kind], timed_out)
            _record(ctx, row, print_line, row.get("error"))
        if running:
            time.sleep(POLL_SECONDS)
    write_outputs(ctx, final=True)
    return ctx.rows


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
    for name in job.after:
        before = ctx.row(name)
        if before is None or before["status"] != "ok":
            return f"needs {name}, which " + ("did not run" if before is None else
                                             f"ended {before['status']}")
    if ctx.remaining() - PACK_RESERVE_SECONDS < MIN_JOB_SECONDS:
        return f"the phase's budget is spent ({ctx.remaining():.0f} s left of {ctx.budget_s:.0f})"
    return ""


@dataclass
class _Running:
    job: Job
    folder: Path
    process: subprocess.Popen
    started: float
    deadline: float
    limit: float
    side_by_side: int = 1    # the most jobs that ran at once while this one ran


def _start(job: Job, ctx: Context, kind: Kind) -> _Running:
    folder = ctx.job_dir(job.name)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    limit = min(job.limit_s, ctx.remaining() - PACK_RESERVE_SECONDS)
    command = kind.command(job, ctx, folder)
    (folder / "command.json").write_text(json.dumps(command) + "\n", encoding="utf-8")
    threads = compile_threads(ctx.parallel if job.group else 1)
    with open(folder / "log.txt", "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, cwd=REPO, env=child_env(threads), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    now = time.monotonic()
    return _Running(job, folder, process, now, now + limit, limit)


def _finish(item: _Running, ctx: Context, kind: Kind, timed_out: bool) -> dict[str, Any]:
    seconds = time.monotonic() - item.started
    extra: dict[str, Any] = {"side_by_side": item.side_by_side}
    try:
        extra.update(kind.collect(item.job, ctx, item.folder))
    except (OSError, ValueError, KeyError) as err:  # no result file: the log tail says why
        extra.setdefault("collect_error", f"{type(err).__name__}: {err}")
    if timed_out:
        status = "timeout"
        error = f"{item.job.name} > {item.limit:.0f} s (killed at its time limit)"
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
    return _row(item.job, status, seconds, error=error, exit_code=item.process.returncode,
                **extra)


def _row(job: Job, status: str, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"job": job.name, "kind": job.kind, "status": status, "seconds": round(seconds, 1),
            "answers": job.answers, **{k: v for k, v in job.spec.items()
                                       if k in ("backend", "model", "compare_with",
                                                "warm_from")},
            **{k: v for k, v in extra.items() if v is not None}}


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(log.read_text("utf-8", "replace").splitlines()[-lines:]) + "\n"
    except OSError:
        return ""


# --- outputs ---------------------------------------------------------------------------------
def summary_data(ctx: Context, final: bool) -> dict[str, Any]:
    from modules.bench.report import machine_info

    place = {name: i for i, name in enumerate(ctx.order)}
    rows = sorted(ctx.rows, key=lambda r: place.get(r["job"], len(place)))
    return {"phase": ctx.phase, "device": ctx.device, "tiny": ctx.tiny, "complete": final,
            "budget_seconds": ctx.budget_s, "parallel": ctx.parallel,
            "elapsed_seconds": round(time.monotonic() - ctx.started, 1),
            "machine": machine_info(), "versions": versions(), "jobs": rows}


def versions() -> dict[str, str | None]:
    """The libraries whose versions decide what compiles (None: not installed)."""
    found: dict[str, str | None] = {}
    for name in ("torch", "triton", "diffusers", "transformers", "peft", "accelerate"):
        try:
            module = __import__(name)
            found[name] = getattr(module, "__version__", "?")
        except ImportError:
            found[name] = None
    import torch
    found["cuda"] = torch.version.cuda
    found["python"] = sys.version.split()[0]
    return found


def write_outputs(ctx: Context, final: bool) -> None:
    """summary.json, summary.md and runs.tar.gz, as they stand; the cache's size at the end."""
    from modules.bench.gpu_report import summary_markdown

    data = summary_data(ctx, final)
    if final:
        cache = ctx.compile_cache()
        data["compile_cache"] = {"bytes": sum(p.stat().st_size for p in cache.rglob("*")
                                              if p.is_file()) if cache.is_dir() else 0}
    _atomic_write(ctx.out / "summary.json", json.dumps(data, indent=2, default=str) + "\n")
    _atomic_write(ctx.out / "summary.md", summary_markdown(data))
    pack_runs(ctx)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


RUN_FILES = ("run.json", "result.json", "benchmark.json", "tests.json", "env.json",
             "lora.json", "model.json", "command.json")


def pack_runs(ctx: Context) -> None:
    """Every job's records (run.json, result JSON) and its log tail, in one small archive."""
    tmp = ctx.out / "runs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        jobs_root = ctx.work / "jobs" / ctx.phase
        for folder in sorted(p for p in jobs_root.glob("*") if p.is_dir()):
            for path in sorted(folder.rglob("*.json")):
                if path.name in RUN_FILES and path.stat().st_size < 4 * MIB:
                    tar.add(path, arcname=f"{folder.name}/{path.relative_to(folder)}")
            tail = log_tail(folder / "log.txt").encode("utf-8")
            info = tarfile.TarInfo(f"{folder.name}/log-tail.txt")
            info.size = len(tail)
            tar.addfile(info, io.BytesIO(tail))
    os.replace(tmp, ctx.out / "runs.tar.gz")
