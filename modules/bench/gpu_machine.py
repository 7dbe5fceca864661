"""What the GPU validation reads of the machine without a CUDA context: the libraries'
versions (installed, or as they import in the env job) and, beside an out-of-memory row, the
card's memory as nvidia-smi reports it."""
from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from typing import Any

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
    from modules.bench.report import torch_build  # its own string has the build ("+cu130")
    found.update(torch_build(), python=sys.version.split()[0])
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
