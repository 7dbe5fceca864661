"""The GPU validation's tables: one phase's `summary.md`, and the merge of returned phases into
docs/benchmarks.md (the block between the GPU markers), docs/benchmarks/gpu/ and a plot."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from modules.util.atomic import atomic_write_text

MIB = 2**20
BEGIN, END = "<!-- gpu-validate:begin -->", "<!-- gpu-validate:end -->"


def _num(value: Any, fmt: str, scale: float = 1.0) -> str:
    if value is None:
        return "—"
    return format(value * scale if scale != 1.0 else value, fmt)


def _mib(value: Any) -> str:
    return _num(value, ".0f", 1 / MIB)


def _cell_text(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell_text(v) for v in row) + " |" for row in rows]
    return lines


def device_line(data: dict[str, Any]) -> str:
    m, v = data["machine"], data["versions"]
    device = m.get("cuda_device") or f"CPU {m.get('cpu')}, {m.get('cpu_cores')} cores"
    parts = [device] + [f"{name} {v[name]}" for name in ("torch", "cuda", "triton", "diffusers",
                                                         "transformers") if v.get(name)]
    return "; ".join(parts) + f"; {m.get('date', '')}"


def _notes(row: dict[str, Any]) -> str:
    notes = [row["error"]] if row.get("error") else []
    notes += row.get("fallbacks") or []
    notes += row.get("degraded") or []
    if row.get("skipped_steps"):
        notes.append(f"{row['skipped_steps']} step(s) skipped: non-finite loss or gradients")
    return "; ".join(notes)


def _effective(row: dict[str, Any]) -> str:
    effective = row.get("effective") or {}
    values = sorted(set(effective.values()))
    if not values and row.get("backend") == "NONE" and row["status"] == "ok":
        return "NONE (eager)"
    return "/".join(values) if values else "—"


def train_rows(rows: list[dict[str, Any]]) -> list[str]:
    header = ["run", "status", "runs as", "compile s", "first step s", "median step s",
              "recompiles after 1st pass", "late recompiles", "CUDA graphs", "peak reserved MiB",
              "peak allocated MiB", "memory plan MiB", "peak RSS MiB", "loss first → last",
              "side by side", "notes"]
    table = []
    for r in rows:
        loss = (f"{r['first_loss']:.4f} → {r['final_loss']:.4f}"
                if r.get("first_loss") is not None and r.get("final_loss") is not None else "—")
        table.append([r["job"], r["status"], _effective(r), _num(r.get("compile_seconds"), ".1f"),
                      _num(r.get("first_step_seconds"), ".2f"),
                      _num(r.get("median_step_seconds"), ".3f"),
                      _num(r.get("recompiles_after_first_pass"), "d"),
                      _num(r.get("late_recompiles"), "d"),
                      "—" if r.get("cudagraphs") is None else ("on" if r["cudagraphs"] else "off"),
                      _mib(r.get("peak_reserved_bytes")), _mib(r.get("peak_allocated_bytes")),
                      _mib(r.get("memory_plan_bytes")), _mib(r.get("peak_rss_bytes")), loss,
                      str(r.get("side_by_side", 1)),
                      _notes(r)])
    return _table(header, table)


def speedups(rows: list[dict[str, Any]]) -> dict[str, tuple[str, float | None]]:
    """job -> (the job it is compared with, that job's median / this one's)."""
    by_name = {r["job"]: r for r in rows}
    found = {}
    for r in rows:
        other = by_name.get(r.get("compare_with") or "")
        ratio = None
        if other and other["status"] == "ok" and r["status"] == "ok" \
                and other.get("median_step_seconds") and r.get("median_step_seconds"):
            ratio = other["median_step_seconds"] / r["median_step_seconds"]
        found[r["job"]] = (other["job"] if other and other is not r else "",
                           ratio if other is not r else None)
    return found


def cell_rows(rows: list[dict[str, Any]]) -> list[str]:
    header = ["cell", "status", "cache", "runs as", "median step ms", "speed-up", "against",
              "first step s", "compile s", "new graphs after warm-up", "CUDA graphs",
              "peak reserved MiB", "peak allocated MiB", "peak RSS MiB", "side by side",
              "notes"]
    ratios = speedups(rows)
    table = []
    for r in rows:
        against, ratio = ratios[r["job"]]
        cache = ("warm" if r.get("warm_cache_found") else "cold") + (
            f" ({r['cache']})" if r.get("cache") else "")
        table.append([r["job"], r["status"], cache, _effective(r),
                      _num(r.get("median_step_seconds"), ".1f", 1000),
                      _num(ratio, ".2f") + ("×" if ratio else ""), against or "—",
                      _num(r.get("first_step_seconds"), ".2f"),
                      _num(r.get("compile_seconds"), ".1f"),
                      _num(r.get("graphs_after_warmup"), "d"),
                      "—" if r.get("cudagraphs") is None else ("on" if r["cudagraphs"] else "off"),
                      _mib(r.get("peak_reserved_bytes")), _mib(r.get("peak_allocated_bytes")),
                      _mib(r.get("peak_rss_bytes")), str(r.get("side_by_side", 1)),
                      _notes(r)])
    return _table(header, table)


def other_rows(rows: list[dict[str, Any]]) -> list[str]:
    table = []
    for r in rows:
        if r["kind"] == "pytest":
            found = (f"{r.get('passed', 0)} passed, {r.get('failed', 0)} failed, "
                     f"{r.get('skipped', 0)} skipped")
        elif r["kind"] == "lora":
            found = "; ".join(f"{name}: mean |Δ| {f['mean_abs_change']:.2e}"
                              for name, f in (r.get("files") or {}).items())
        elif r["kind"] == "build":
            found = (f"{_num(r.get('unet_parameters'), ',d')} UNet parameters, "
                     f"{_mib(r.get('folder_bytes'))} MiB folder") if r.get("path") else ""
        elif r["kind"] == "env":
            gpu = r.get("gpu") or {}
            found = ", ".join(f"{k} {v}" for k, v in gpu.items()) or "no GPU"
            found += "; " + ", ".join(f"{b}: {why}" for b, why in (r.get("backends") or {})
                                      .items())
        else:
            found = ""
        table.append([r["job"], r["status"], _num(r.get("seconds"), ".0f"), found,
                      r.get("error") or "", r.get("answers", "")])
    return _table(["job", "status", "s", "found", "error", "answers"], table)


def phase_markdown(data: dict[str, Any], heading: str = "##") -> str:
    """One phase's tables (train runs, timed cells, the other jobs)."""
    jobs = data["jobs"]
    state = "complete" if data.get("complete") else "partial (written while it ran)"
    lines = [f"{heading} Phase {data['phase']}" + (" (tiny rehearsal)" if data.get("tiny")
                                                    else ""),
             "", f"{device_line(data)}. {state}; {data['elapsed_seconds']:.0f} s of a "
             f"{data['budget_seconds']:.0f} s budget; up to {data['parallel']} runs side by side.",
             ""]
    trains = [r for r in jobs if r["kind"] == "train"]
    cells = [r for r in jobs if r["kind"] == "cell"]
    others = [r for r in jobs if r["kind"] not in ("train", "cell")]
    if trains:
        lines += ["Training runs through `scripts/train.py` (step times of runs side by side "
                  "shared the GPU; the timed cells measure alone):", "", *train_rows(trains), ""]
    if cells:
        lines += ["Timed cells (median of the clean steps; CUDA events on a GPU). A speed-up "
                  "is only given between cells that ran alone; cells side by side (the cold "
                  "starts, the fine-tunes) shared the GPU, but their memory peaks are their "
                  "own:", "", *cell_rows(cells), ""]
    if others:
        lines += [*other_rows(others), ""]
    cache = data.get("compile_cache")
    if cache:
        lines += [f"Compile cache at the end of the phase: {_mib(cache.get('bytes'))} MiB.", ""]
    return "\n".join(lines)


def summary_markdown(data: dict[str, Any]) -> str:
    return phase_markdown(data, heading="#")


# --- merge into the docs -----------------------------------------------------------------------
def merge_results(out_dirs: list[Path], docs: Path, allow_rehearsal: bool = False) -> list[Path]:
    """Fold returned phase folders into ``docs``: raw files under benchmarks/gpu/, the GPU
    block of benchmarks.md, and images/gpu-validate.png. Returns the files written."""
    raw = docs / "benchmarks" / "gpu"
    raw.mkdir(parents=True, exist_ok=True)
    written = []
    for out in out_dirs:
        summary = out / "summary.json"
        if not summary.is_file():
            raise FileNotFoundError(f"{summary} does not exist: is {out} a phase's output?")
        data = json.loads(summary.read_text(encoding="utf-8"))
        if (data.get("tiny") or data.get("device") != "cuda") and not allow_rehearsal:
            raise ValueError(f"{summary} is a rehearsal ({'tiny, ' if data.get('tiny') else ''}"
                             f"device {data.get('device')}): not a GPU result for the docs")
        target = raw / f"{data['phase']}.json"
        atomic_write_text(target, json.dumps(data, indent=2) + "\n")
        written.append(target)
        if (out / "runs.tar.gz").is_file():
            shutil.copyfile(out / "runs.tar.gz", raw / f"{data['phase']}-runs.tar.gz")
            written.append(raw / f"{data['phase']}-runs.tar.gz")
    phases = load_phases(raw)
    page = docs / "benchmarks.md"
    atomic_write_text(page, replace_block(page.read_text(encoding="utf-8"), gpu_block(phases)))
    written.append(page)
    plot = docs / "images" / "gpu-validate.png"
    if write_plot(phases, plot):
        written.append(plot)
    return written


def load_phases(raw: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8"))
            for p in sorted(raw.glob("*.json"))]


def replace_block(page: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """`page` with the text between the `begin` and `end` markers replaced by `block`."""
    if begin not in page or end not in page:
        raise ValueError(f"benchmarks.md has no {begin} … {end} block to replace")
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{block.rstrip()}\n{end}{tail}"


def gpu_block(phases: list[dict[str, Any]]) -> str:
    if not phases:
        return "No phase has been measured yet."
    lines = ["![step time and cold start per backend](images/gpu-validate.png)", "",
             *target_lines(phases), ""]
    for data in phases:
        lines.append(phase_markdown(data, heading="###"))
    return "\n".join(lines)


def _jobs(phases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every phase's rows by job name, each tagged with its phase."""
    return {r["job"]: {**r, "phase": data["phase"]} for data in phases for r in data["jobs"]}


def target_lines(phases: list[dict[str, Any]]) -> list[str]:
    """The engine's targets against what the phases measured, honestly: "not measured" where
    a phase that answers it has not run."""
    jobs = _jobs(phases)
    ok = {name: r for name, r in jobs.items() if r["status"] == "ok"}

    def median(name: str) -> float | None:
        return (ok.get(name) or {}).get("median_step_seconds")

    eager = median("cell-sd15-none")
    # Timings compare only within one phase: another phase may have run on another card.
    same = (ok.get("cell-sd15-none") or {}).get("phase")
    ratios = {name: eager / r["median_step_seconds"] for name, r in ok.items()
              if name.startswith("cell-sd15-") and r.get("median_step_seconds") and eager
              and r["phase"] == same and name != "cell-sd15-none"}
    best = max(ratios.items(), key=lambda kv: kv[1]) if ratios else None
    warm = [(name, r["compile_seconds"], (ok.get(r.get("warm_from") or "") or {})
             .get("compile_seconds")) for name, r in ok.items()
            if name.startswith("cell-sd15-") and r.get("warm_cache_found")
            and r.get("compile_seconds") is not None]
    warm = [(n, w, c) for n, w, c in warm if c]
    late = [(name, (r.get("late_recompiles") or 0) + (r.get("recompiles_after_first_pass") or 0))
            for name, r in ok.items() if r["kind"] == "train" and r.get("effective")
            and set(r["effective"].values()) != {"NONE"}]
    eager_mem = (ok.get("cell-sd15-none") or {}).get("peak_reserved_bytes")
    mem = [(name, r["peak_reserved_bytes"] / eager_mem) for name, r in ok.items()
           if name.startswith("cell-sd15-") and name != "cell-sd15-none" and eager_mem
           and r.get("peak_reserved_bytes") and r["phase"] == same]
    rows = [
        ["best backend ≥ 1.5× eager steady-state step (SD 1.5 LoRA)",
         f"{best[0]}: {best[1]:.2f}×" if best else "not measured (phase 3)"],
        ["REGIONAL cold start ≤ ¼ of FULL, with ≥ 90% of its speed",
         regional_against_full(jobs) or "not measured (phase 5)"],
        ["warm start ≤ 10% of cold (compile seconds)",
         "; ".join(f"{n}: {w:.1f} s of {c:.1f} s ({w / c:.0%}; the cold one side by side)"
                   for n, w, c in warm) or "not measured (phase 2)"],
        ["0 recompiles after warm-up, sampling included",
         "; ".join(f"{n}: {k}" for n, k in late) or "not measured (phase 1)"],
        ["compiled peak reserved memory ≤ 1.1× eager",
         "; ".join(f"{n}: {x:.2f}×" for n, x in mem) or "not measured (phase 2)"],
    ]
    return ["Targets (reported, not asserted):", "", *_table(["target", "measured"], rows)]


def regional_against_full(jobs: dict[str, dict[str, Any]]) -> str:
    """Phase 5's two INDUCTOR runs, each alone: cold compile and median step, REGIONAL
    against FULL. A FULL run killed at its limit still answers: its cold start took longer."""
    regional, full = jobs.get("train-sd15-inductor-alone"), jobs.get("train-sd15-inductor-full")
    if not regional or regional["status"] != "ok" or not full:
        return ""
    cold = regional.get("compile_seconds")
    if full["status"] == "timeout":
        return (f"REGIONAL {cold:.0f} s cold; FULL did not finish within {full['seconds']:.0f} s"
                if cold is not None else "")
    full_cold, steps = full.get("compile_seconds"), (regional.get("median_step_seconds"),
                                                     full.get("median_step_seconds"))
    if full["status"] != "ok" or not full_cold or cold is None:
        return ""
    text = f"{cold:.0f} s vs {full_cold:.0f} s cold ({cold / full_cold:.2f})"
    if all(steps):
        text += f"; REGIONAL runs at {steps[1] / steps[0]:.0%} of FULL's speed (median step)"
    return text + "; each alone"


def write_plot(phases: list[dict[str, Any]], path: Path) -> bool:
    """Median step time (timed cells) and cold compile seconds (train runs) per backend."""
    jobs = _jobs(phases)
    cells = [r for r in jobs.values() if r["kind"] == "cell" and r["status"] == "ok"
             and r.get("median_step_seconds") and r.get("side_by_side", 1) == 1]
    trains = [r for r in jobs.values() if r["kind"] == "train" and r["status"] == "ok"]
    if not cells and not trains:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.8))
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    left.barh([r["job"] for r in cells], [r["median_step_seconds"] * 1000 for r in cells],
              color="tab:blue")
    left.set_title("median step ms, alone (lower is better)")
    right.barh([r["job"] for r in trains], [r.get("compile_seconds") or 0 for r in trains],
               color="tab:red")
    right.set_title("cold compile seconds in train.py (lower is better)")
    for axis in (left, right):
        axis.tick_params(axis="y", labelsize=7)
    figure.suptitle(device_line(phases[0]))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return True
