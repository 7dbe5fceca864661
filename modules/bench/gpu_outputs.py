"""What a GPU validation phase writes to its output folder as it goes, and what it reads of the
machine for it: the summary (JSON and markdown), the runs archive, the libraries' versions and,
beside an out-of-memory row, the card's memory. Written after every job, so a command killed
from outside still returns what it measured."""
from __future__ import annotations

import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modules.bench.gpu_validate import Context

MIB = 2**20
LOG_TAIL_LINES = 60
# The libraries whose versions decide what compiles, as the summary records them.
LIBRARIES = ("torch", "triton", "diffusers", "transformers", "peft", "accelerate")


def card_memory(smi: str = "nvidia-smi") -> dict[str, Any]:
    """The GPU's memory as nvidia-smi sees it now, and what each process on it holds (MiB):
    beside an out-of-memory row, it tells a neighbour's use from the job's own. Needs no
    CUDA context. ``{"error": ...}`` when it cannot be read."""
    if shutil.which(smi) is None:
        return {"error": f"{smi} not found"}
    try:
        card = subprocess.run([smi, "--query-gpu=memory.total,memory.used,memory.free",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.splitlines()[0]
        apps = subprocess.run([smi, "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.splitlines()
        total, used, free = (int(float(x)) for x in card.split(","))
        processes = [{"pid": int(pid), "used_mib": int(float(mib))}
                     for pid, mib in (line.split(",") for line in apps if line.strip())]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as err:
        return {"error": f"{smi}: {type(err).__name__}: {err}"}
    return {"total_mib": total, "used_mib": used, "free_mib": free, "processes": processes}


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
            "elapsed_seconds": round(time.monotonic() - ctx.started, 1),
            "machine": machine, "versions": ctx.versions(), "jobs": rows}


def installed_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    """The libraries' versions as their installed metadata says (None: not installed),
    without importing them: the runner only starts and watches jobs, and importing diffusers
    and the rest costs seconds in every phase. The env job's `versions` imports them."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    import torch  # the runner has it anyway; its own string has the build ("+cu130")
    found.update(torch=torch.__version__, cuda=torch.version.cuda,
                 python=sys.version.split()[0])
    return found


def versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    """The libraries whose versions decide what compiles, as they import (the env job): None
    when not installed, and the error when importing one fails in any other way (a broken
    install must not cost the phase its environment row: it is a finding)."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            module = __import__(name)
            found[name] = getattr(module, "__version__", "?")
        except ImportError:
            found[name] = None
        except Exception as err:  # noqa: BLE001 - recorded in the summary, not swallowed
            found[name] = f"import failed: {type(err).__name__}: {err}"[:300]
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
