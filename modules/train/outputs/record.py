"""The run record (`<output>/run.json`): what ran, where, how fast, and what it wrote."""
from __future__ import annotations

import json
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from modules.util.atomic import atomic_write_text
from modules.util.secrets import mask_tree


def library_versions() -> dict[str, str]:
    import diffusers
    import peft
    import transformers
    import torch
    return {"python": platform.python_version(), "torch": torch.__version__,
            "diffusers": diffusers.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__}


def device_description(device) -> str:
    """The device a run trains on, in words (a torch.device)."""
    import torch
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def peak_memory(cuda: bool) -> dict:
    """Peak memory of this process so far. On CUDA both the caching allocator's allocated and
    reserved peaks (CUDA graphs keep private pools reserved that "allocated" does not show);
    the CPU has no such counters, so there only the process's peak RSS is measured (RSS is
    always included)."""
    # ru_maxrss is KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    memory: dict = {
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
        "peak_allocated_bytes": None, "peak_reserved_bytes": None,
        "memory_measured": "process peak RSS (CPU: no allocator counters)"}
    if cuda:
        import torch
        memory.update(peak_allocated_bytes=int(torch.cuda.max_memory_allocated()),
                      peak_reserved_bytes=int(torch.cuda.max_memory_reserved()),
                      memory_measured="torch.cuda.max_memory_allocated / max_memory_reserved")
    return memory


def read_run_status(output_dir: Path) -> str:
    """The `status` in a run's run.json ('' when there is none, or it is unreadable)."""
    try:
        return str(json.loads((Path(output_dir) / "run.json").read_text("utf-8")).get("status", ""))
    except (OSError, ValueError, AttributeError):
        return ""


@dataclass
class RunRecord:
    """Everything run.json holds; written at start, after each save and at the end."""
    path: Path
    enabled: bool = True  # only one process of a multi-process run writes the record
    started: float = field(default_factory=time.time)
    data: dict = field(default_factory=dict)
    losses: list[float | None] = field(default_factory=list)  # None: a skipped step
    step_seconds: list[float] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    steps_before: int = 0  # steps of earlier segments (a resumed run)

    def add_file(self, path: Path) -> None:
        text = str(path)
        if text not in self.files:
            self.files.append(text)

    def summary(self) -> dict:
        """Derived numbers: step counts, losses, median step time without the first step."""
        later_steps = self.step_seconds[1:]
        finite = [x for x in self.losses if x is not None]  # a skipped (NaN) step holds None
        return {
            "steps_done": self.steps_before + len(self.step_seconds),
            "final_loss": finite[-1] if finite else None,
            "mean_loss": statistics.fmean(finite) if finite else None,
            "first_step_seconds": self.step_seconds[0] if self.step_seconds else None,
            "median_step_seconds": statistics.median(later_steps) if later_steps else None,
            "wall_seconds": round(time.time() - self.started, 3),
            "output_files": list(self.files),
        }

    def continue_from(self, previous: dict, step: int, **resume) -> None:
        """Carry an interrupted run's record on from the backup's `step`: its losses up to
        there, its files, the ended segment's wall time in `segments`, and `resume`."""
        summary_keys = set(self.summary()) | {"losses"}
        self.data = {k: v for k, v in previous.items() if k not in summary_keys}
        self.losses = list(previous.get("losses", []))[:step]
        self.files = list(previous.get("output_files", []))
        self.steps_before = step
        ended = {"from_step": previous.get("resumed_at_step", 0),
                 "steps_done": previous.get("steps_done"), "status": previous.get("status"),
                 "wall_seconds": previous.get("wall_seconds")}
        self.data.update(resume_count=int(previous.get("resume_count", 0)) + 1,
                         segments=[*previous.get("segments", []), ended],
                         resumed_at_step=step, **resume)

    def write(self, **updates) -> None:
        self.data.update(updates)
        if not self.enabled:
            return
        # a secret-looking value (a token in a prompt, say) is never written down
        payload = mask_tree({**self.data, **self.summary(), "losses": self.losses})
        atomic_write_text(self.path, json.dumps(payload, indent=2, default=str) + "\n")
