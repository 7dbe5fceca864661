"""Cold compile times measured on GPUs, for a first run's estimate.

A run's compile estimate comes from this machine's own history (`modules.train.state.history`);
the first run with some settings has none. On a CUDA device it can still say what a GPU phase
measured for the same family, backend and scope (`scripts/gpu_validate.py merge` writes the
table, `measured_compiles.json` beside this file, from the phases merged into
docs/benchmarks.md): a cold compile that ended gives its seconds, one stopped at its time limit
gives a lower bound. Rows are data; nothing here is guessed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.util.duration import format_duration

TABLE = Path(__file__).with_name("measured_compiles.json")


@dataclass(frozen=True)
class MeasuredCompile:
    family: str                 # model.type value (SD15, SDXL, ZIMAGE, ...)
    label: str                  # the family as users read it ("SD 1.5")
    backend: str
    scope: str
    device: str                 # the GPU's name
    resolution: int
    batch: int
    seconds: float              # compile seconds; with ``ended`` False, how long it ran
    ended: bool                 # False: stopped at its limit before the compile ended
    phase: str

    def text(self) -> str:
        took = (f"{format_duration(self.seconds)}" if self.ended
                else f"over {format_duration(self.seconds)} (stopped before it ended)")
        return (f"{self.backend} {self.scope} compiled {self.label} ({self.resolution} px, batch "
                f"{self.batch}) in {took} cold on an {self.device}")


def load_table(path: Path = TABLE) -> list[MeasuredCompile]:
    """The table's rows; a missing table is an empty one. A damaged table raises: it is a file
    of the repository, so a fault in it is a defect to fix, not a user's input."""
    if not path.is_file():
        return []
    data = json.loads(path.read_text(encoding="utf-8"))
    return [MeasuredCompile(**row) for row in data["rows"]]


def measured_compile(family: str, backend: str, scope: str,
                     table: list[MeasuredCompile] | None = None) -> MeasuredCompile | None:
    """The GPU measurement for these settings, preferring one whose compile ended."""
    rows = [r for r in (load_table() if table is None else table)
            if (r.family, r.backend, r.scope) == (family, backend, scope)]
    rows.sort(key=lambda r: (not r.ended, r.phase))
    return rows[0] if rows else None


def table_rows(phases: list[dict[str, Any]], jobs_of: Any, sizes: dict[str, Any],
               labels: dict[str, str]) -> list[dict[str, Any]]:
    """The table's rows from merged GPU phases (their summary.json data): every cell or run
    that compiled from an empty cache **alone** (side by side, the CPU was shared: an upper
    bound of no use here), ended or stopped at its limit. ``jobs_of(phase_key)``: the phase's
    jobs as planned (their overrides say the scope and any other batch size); ``sizes``: the
    phases' full sizes by key (model_type, resolution, batch); ``labels``: model.type value → the family's name as users read it."""
    rows = []
    for phase in phases:
        if phase.get("tiny") or phase.get("device") != "cuda":
            continue
        planned = {job.name: job for job in jobs_of(phase["phase"])}
        device = phase["machine"].get("cuda_device") or "unknown GPU"
        for row in phase["jobs"]:
            job = planned.get(row["job"])
            if (job is None or row["kind"] not in ("cell", "train")
                    or row.get("backend") in (None, "NONE") or row.get("side_by_side", 1) != 1
                    or row.get("warm_cache_found") or row.get("warm_from")
                    or job.spec.get("bundle_from")):
                continue
            ended = row["status"] == "ok" and bool(row.get("compile_seconds"))
            stopped = row["status"] == "timeout" and bool(row.get("seconds"))
            if not (ended or stopped):
                continue
            size = sizes[job.spec["size"]]
            scope = next((o.split("=", 1)[1] for o in job.spec.get("overrides", [])
                          if o.startswith("compile.scope=")), "REGIONAL")
            batch = next((int(o.split("=", 1)[1]) for o in job.spec.get("overrides", [])
                          if o.startswith("training.batch_size=")), size.batch)
            rows.append({"family": size.model_type, "label": labels[size.model_type],
                         "backend": row["backend"], "scope": scope, "device": device,
                         "resolution": size.resolution, "batch": batch,
                         "seconds": round(float(row["compile_seconds"] if ended
                                                else row["seconds"]), 1),
                         "ended": ended, "phase": phase["phase"]})
    return rows
