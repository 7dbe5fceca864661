"""What a GPU validation phase writes to its output folder as it goes: the summary (JSON and
markdown) and the runs archive (what it reads of the machine: gpu_machine.py). Written after
every job, so a command killed from outside still returns what it measured."""
from __future__ import annotations

import io
import json
import os
import tarfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modules.bench.gpu_context import Context

MIB = 2**20
LOG_TAIL_LINES = 60


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(log.read_text("utf-8", "replace").splitlines()[-lines:]) + "\n"
    except OSError:
        return ""


# --- outputs ---------------------------------------------------------------------------------
def summary_data(ctx: Context, final: bool) -> dict[str, Any]:
    place = {name: i for i, name in enumerate(ctx.order)}
    rows = sorted(ctx.rows, key=lambda r: place.get(r["job"], len(place)))
    env = ctx.row("env") or {}
    machine = {**ctx.machine(), "cuda_device": (env.get("gpu") or {}).get("name")}
    return {"phase": ctx.phase, "device": ctx.device, "tiny": ctx.tiny, "complete": final,
            "commit": ctx.commit, "budget_seconds": ctx.budget_s, "parallel": ctx.parallel,
            "overrides": list(ctx.overrides),
            "elapsed_seconds": round(time.monotonic() - ctx.started, 1),
            "machine": machine, "versions": ctx.versions(), "jobs": rows}




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
             "lora.json", "model.json", "command.json", "progress.json")


def pack_runs(ctx: Context) -> None:
    """Every job's records (run.json, result JSON) and its log tail, in one small archive."""
    tmp = ctx.out / "runs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for folder in sorted(p for p in ctx.jobs_root().glob("*") if p.is_dir()):
            for path in sorted(folder.rglob("*.json")):
                if path.name in RUN_FILES and path.stat().st_size < 4 * MIB:
                    tar.add(path, arcname=f"{folder.name}/{path.relative_to(folder)}")
            tail = log_tail(folder / "log.txt").encode("utf-8")
            info = tarfile.TarInfo(f"{folder.name}/log-tail.txt")
            info.size = len(tail)
            tar.addfile(info, io.BytesIO(tail))
    os.replace(tmp, ctx.out / "runs.tar.gz")
