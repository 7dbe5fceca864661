"""``scripts/gpu_validate.py``: one GPU validation phase per command, ``--list``, ``merge``.

    python scripts/gpu_validate.py --list                        # ends with the next command
    python scripts/gpu_validate.py 1 --commit SHA --out "$OUT"   # on the GPU machine
    python scripts/gpu_validate.py 1 --device cpu --tiny --out x  # the rehearsal here
    python scripts/gpu_validate.py merge PATH [PATH ...]          # fold returned phases in docs/

docs/gpu.md has the exact commands for the lent machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from modules.bench.gpu_context import Context
from modules.bench.gpu_validate import REPO, PhaseStopped

DEFAULT_WORK = Path("/tmp/tempera-gpu-work")
DEFAULT_BUDGET = 540.0  # the lending machine kills a command at 600 s


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip().upper() for part in text.split(",") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu_validate.py", description="GPU validation: one phase per command, each "
        "ending by itself inside its budget and writing what it has as it goes.")
    p.add_argument("phase", nargs="?", help="a phase (number or name; see --list), or 'merge'")
    p.add_argument("paths", nargs="*", type=Path, help="merge: returned output folders")
    p.add_argument("--list", action="store_true", help="the phases, expected minutes, results")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true",
                   help="the built-in tiny models and short runs (the CPU rehearsal)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-out"),
                   help="what comes back: at most 8 files (default $OUT, else ./gpu-out)")
    p.add_argument("--work", type=Path, default=DEFAULT_WORK,
                   help=f"models, runs and compile caches (default {DEFAULT_WORK}: on a warm "
                        "machine the next phase reuses the built models)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help=f"seconds the whole phase may take (default {DEFAULT_BUDGET:.0f})")
    p.add_argument("--parallel", type=int,
                   help="runs side by side in a group (default 6 on CUDA, 1 on the CPU)")
    p.add_argument("--backends", type=_csv,
                   help="comma list: run only the jobs of these backends (others: not started)")
    p.add_argument("--jobs", type=lambda text: tuple(j.strip() for j in text.split(",")
                                                     if j.strip()),
                   help="comma list of job names: run only these, say to rerun one after a "
                        "fix (what they need must be among them; others: not started)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE",
                   help="a config override for every train and cell run of the phase, after "
                        "the phase's own (repeatable; the summary records it): the CPU "
                        "rehearsal's inductor test trains one image shape with "
                        "data.aspect_buckets=false")
    p.add_argument("--commit",
                   help="the commit the source is at, recorded in the summary (the copy on a "
                        "lent GPU machine has no .git: --list prints the command with it); "
                        "default: git's answer here, if there is one")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="merge: the docs folder")
    p.add_argument("--allow-rehearsal", action="store_true",
                   help="merge: accept CPU / --tiny results (tests only)")
    return p


def list_phases(docs: Path) -> str:
    """Every phase, its minutes, what it measures and its results; then which to run next
    (a lent session has time for one) and the command for it, with this checkout's commit."""
    from modules.bench.gpu_packages import extra_wheels, wheels_command
    from modules.bench.gpu_phases import PHASES, phase_packages

    lines, missing = [], []
    for phase in PHASES:
        result = docs / "benchmarks" / "gpu" / f"{phase.key}.json"
        if result.is_file():
            data = json.loads(result.read_text(encoding="utf-8"))
            done = sum(1 for r in data["jobs"] if r["status"] == "ok")
            have = (f"results: {data['machine'].get('date', '?')[:10]} on "
                    f"{data['machine'].get('cuda_device') or 'CPU'} ({done}/{len(data['jobs'])} "
                    "jobs ok)")
        else:
            have = "no results yet"
            missing.append(phase)
        lines.append(f"{phase.key:<20} ~{phase.minutes:g} min  {phase.answers}\n"
                     f"{'':<20} {phase.topic}; {have}")
    lines.append("")
    if not missing:
        lines.append("next: every phase has results; rerun one to measure again")
        return "\n".join(lines)
    following = missing[0]
    lines.append(f"next: phase {following.key} (a lent session's 15 minutes hold one phase; "
                 "docs/gpu.md has the call):")
    if extra_wheels(phase_packages(following)):
        lines.append("first, here, put the wheels it needs besides the default ones in .whl/: "
                     + wheels_command(phase_packages(following)))
    lines.append(gpu_command(following.key.split("-")[0], source_commit(None)))
    return "\n".join(lines)


def gpu_command(phase: str, commit: str | None) -> str:
    """The lent GPU machine's command for ``phase``: the carried wheels into .site/, then the
    phase with the commit it runs (the copy there has no .git)."""
    return ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
            "--upgrade --target .site .whl/*.whl && export PYTHONPATH=$PWD/.site:$PWD || exit; "
            f"PYTHONUNBUFFERED=1 python3 scripts/gpu_validate.py {phase}"
            + (f" --commit {shlex.quote(commit)}" if commit else "") + " --out $OUT")


def source_commit(given: str | None) -> str | None:
    """``given``, else this checkout's commit from git (with "-dirty" when files differ from
    it: the working tree is what a lent machine gets), else None."""
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None  # no git here (the lent machine's copy): the summary says "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        print(list_phases(args.docs))
        return 0
    if not args.phase:
        build_parser().print_usage(sys.stderr)
        print("error: name a phase (see --list) or 'merge'", file=sys.stderr)
        return 2
    if args.phase == "merge":
        return merge(args)
    return run(args)


def merge(args: argparse.Namespace) -> int:
    from modules.bench.gpu_report import merge_results

    if not args.paths:
        print("error: merge needs the returned output folder(s)", file=sys.stderr)
        return 2
    try:
        # the estimate's table of measured compiles belongs with the repository's own docs
        from modules.bench.gpu_phases import measured_table
        from modules.compile.measured import TABLE
        own_docs = args.docs.resolve() == (REPO / "docs").resolve() and not args.allow_rehearsal
        written = merge_results(args.paths, args.docs, allow_rehearsal=args.allow_rehearsal,
                                measured=(TABLE, measured_table) if own_docs else None)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: merge: {err}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def run(args: argparse.Namespace) -> int:
    from modules.bench.gpu_jobs import KINDS
    from modules.bench.gpu_phases import find_phase, phase_jobs
    from modules.bench.gpu_validate import run_phase

    try:
        phase = find_phase(args.phase)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("error: no CUDA GPU here; rehearse with --device cpu --tiny", file=sys.stderr)
            return 2
    from modules.config import Config, ConfigError, apply_overrides
    try:
        apply_overrides(Config(), args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    jobs = phase_jobs(phase, args.tiny)
    unknown = sorted(set(args.jobs or ()) - {job.name for job in jobs})
    if unknown:
        print(f"error: --jobs: phase {phase.key} has no job {', '.join(unknown)}; its jobs: "
              + ", ".join(job.name for job in jobs), file=sys.stderr)
        return 2
    parallel = args.parallel or (6 if args.device == "cuda" else 1)
    if phase.max_parallel:
        parallel = min(parallel, phase.max_parallel)
    ctx = Context(phase=phase.key, device=args.device, tiny=args.tiny, out=args.out,
                  work=args.work, budget_s=args.budget, parallel=parallel,
                  backends=args.backends, jobs=args.jobs, commit=source_commit(args.commit),
                  overrides=tuple(args.overrides))
    print(f"phase {phase.key}: {phase.answers} (budget {args.budget:.0f} s, commit "
          f"{ctx.commit or 'unknown'})", flush=True)
    code = 0
    try:
        run_phase(ctx, jobs, KINDS, print_line=lambda line: print(line, flush=True))
    except PhaseStopped as stop:  # every job is killed and the results so far are written
        print(f"stopped: {stop}", flush=True)
        code = 128 + stop.signum
    print((ctx.out / "summary.md").read_text(encoding="utf-8"))  # the table, printed last
    return code
