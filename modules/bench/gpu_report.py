"""The GPU validation's tables: one phase's `summary.md`, and the merge of returned phases into
docs/benchmarks.md (the block between the GPU markers), docs/benchmarks/gpu/ and a plot."""
from __future__ import annotations

import json
import shutil
import textwrap
from collections.abc import Callable
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
    return "; ".join(parts) + f"; {m.get('date', '')}; commit {data.get('commit') or 'unknown'}"


def _progress(row: dict[str, Any]) -> str:
    """What a run that did not finish had done, from its last progress.json."""
    progress = row.get("progress") or {}
    if row["status"] == "ok" or not progress:
        return ""
    total = progress.get("max_steps")
    text = f"last progress: step {progress.get('step', 0)}" + (f"/{total}" if total else "")
    return text + (f", {progress['compile']}" if progress.get("compile") else "")


def _card_memory(row: dict[str, Any]) -> str:
    """The card's memory when an out-of-memory job ended: a neighbour's use shows here."""
    card = row.get("card_memory")
    if not card:
        return ""
    if "error" in card:
        return f"card memory not read: {card['error']}"
    held = ", ".join(f"pid {p['pid']} {p['used_mib']} MiB" for p in card.get("processes", []))
    return (f"card when it ended: {card['free_mib']} MiB free of {card['total_mib']} MiB"
            + (f" (held: {held})" if held else ""))


def _partial(row: dict[str, Any]) -> str:
    """A cell whose median comes from fewer clean steps than it asked for, and why."""
    if not row.get("partial"):
        return ""
    return (f"partial steady window: {len(row.get('timed_steps') or [])} of "
            f"{row.get('steps_wanted')} clean steps"
            + (" (it stopped itself at its time limit)" if row.get("stopped_at_time_limit")
               else ""))


def _notes(row: dict[str, Any]) -> str:
    notes = [row["error"]] if row.get("error") else []
    notes += [text for text in (_progress(row), _partial(row), _card_memory(row)) if text]
    notes += row.get("fallbacks") or []
    notes += row.get("degraded") or []
    if row.get("skipped_steps"):
        notes.append(f"{row['skipped_steps']} step(s) skipped: non-finite loss or gradients")
    if row.get("gpu_build_error"):
        notes.append(f"built on the CPU: the GPU build raised {row['gpu_build_error']}")
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


def speedup_text(row: dict[str, Any], ratio: float | None) -> str:
    """The speed-up column: the ratio, or, for a cold cell killed at its limit, how long its
    cold start ran (alone, or side by side): a finding too."""
    if ratio:
        return f"{ratio:.2f}×" + (" (partial)" if row.get("partial") else "")
    if row["status"] == "timeout" and not row.get("warm_cache_found"):
        alone = "alone" if row.get("side_by_side", 1) == 1 else "side by side"
        return f"cold start > {row['seconds']:.0f} s {alone}"
    return "—"


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
                      speedup_text(r, ratio), against or "—",
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
        if r["status"] == "not started":
            found = ""
        elif r["kind"] == "pytest":
            found = (f"{r.get('passed', 0)} passed, {r.get('failed', 0)} failed, "
                     f"{r.get('skipped', 0)} skipped")
        elif r["kind"] == "lora":
            found = "; ".join(f"{name}: mean |Δ| {f['mean_abs_change']:.2e}"
                              for name, f in (r.get("files") or {}).items())
        elif r["kind"] == "build":
            found = (f"{_num(r.get('unet_parameters'), ',d')} denoiser parameters, "
                     f"{_mib(r.get('folder_bytes'))} MiB folder, built on "
                     f"{r.get('built_on', '?')}") if r.get("path") else ""
            if r.get("gpu_build_error"):
                found += f" (the GPU build raised {r['gpu_build_error']})"
        elif r["kind"] == "env":
            gpu = r.get("gpu") or {}
            found = ", ".join(f"{k} {v}" for k, v in gpu.items()) or "no GPU"
            found += "; TF32 " + _tf32(r.get("tf32"))
            found += "; " + ", ".join(f"{b}: {why}" for b, why in (r.get("backends") or {})
                                      .items())
        else:
            found = ""
        table.append([r["job"], r["status"], _num(r.get("seconds"), ".0f"), found,
                      _notes(r), r.get("answers", "")])
    return _table(["job", "status", "s", "found", "notes", "answers"], table)


def _tf32(tf32: dict[str, Any] | None) -> str:
    """TF32 as the runs set it (the env job applies the trainer's switch)."""
    if not tf32:
        return "not recorded"
    if "error" in tf32:
        return f"not read: {tf32['error']}"
    if not tf32.get("applied"):
        return f"untouched ({tf32.get('why', 'not applied')})"
    return (f"{'on' if tf32.get('matmul_allow_tf32') else 'off'} for matmuls, "
            f"{'on' if tf32.get('cudnn_allow_tf32') else 'off'} for cuDNN "
            f"(float32 matmul precision {tf32.get('float32_matmul_precision')})")


def phase_markdown(data: dict[str, Any], heading: str = "##") -> str:
    """One phase's tables (train runs, timed cells, the other jobs)."""
    jobs = data["jobs"]
    state = "complete" if data.get("complete") else "partial (written while it ran)"
    lines = [f"{heading} Phase {data['phase']}" + (" (tiny rehearsal)" if data.get("tiny")
                                                    else ""),
             "", f"{device_line(data)}. {state}; {data['elapsed_seconds']:.0f} s of a "
             f"{data['budget_seconds']:.0f} s budget; up to {data['parallel']} runs side by side."
             + (" Every run with --set " + ", ".join(f"`{o}`" for o in data["overrides"]) + "."
                if data.get("overrides") else ""), ""]
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
def merge_results(out_dirs: list[Path], docs: Path, allow_rehearsal: bool = False,
                  measured: tuple[Path, Callable[[list[dict[str, Any]]], dict[str, Any]]]
                  | None = None) -> list[Path]:
    """Fold returned phase folders into ``docs``: raw files under benchmarks/gpu/, the GPU
    block of benchmarks.md, and images/gpu-validate.png; with ``measured`` (a path and what
    makes its table from the phases: `gpu_phases.measured_table`), the table of cold compile
    times a first run's estimate quotes (`modules.compile.measured`). Returns the files
    written."""
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
    if measured is not None:
        atomic_write_text(measured[0], json.dumps(measured[1](phases), indent=1) + "\n")
        written.append(measured[0])
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


def _jobs(phases: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Every phase's rows keyed by (phase, job), each tagged with its phase: two phases may
    have a job of the same name (each phase's eager cell), and neither replaces the other."""
    return {(data["phase"], r["job"]): {**r, "phase": data["phase"]}
            for data in phases for r in data["jobs"]}


EAGER_CELL = "cell-sd15-none"


def _against_eager(jobs: dict[tuple[str, str], dict[str, Any]]) -> list[tuple[dict, dict]]:
    """(cell, its phase's eager cell) for every cell timed alone against eager: timings
    compare only within one phase (another phase may have run on another card)."""
    pairs = []
    for (phase, name), r in jobs.items():
        eager = jobs.get((phase, EAGER_CELL))
        if r["kind"] == "cell" and r.get("compare_with") == EAGER_CELL and eager \
                and eager["status"] == "ok":
            pairs.append((r, eager))
    return pairs


def _label(row: dict[str, Any]) -> str:
    return f"{row['job']} ({row['phase']})"


def best_speedup(jobs: dict[tuple[str, str], dict[str, Any]]) -> str:
    """The best ratio to eager of a cell timed alone, and every cold start that did not end
    inside its limit alone (the presets' INDUCTOR may not: that is the finding then)."""
    ratios = [(r, eager["median_step_seconds"] / r["median_step_seconds"])
              for r, eager in _against_eager(jobs) if r["status"] == "ok"
              and r.get("median_step_seconds") and eager.get("median_step_seconds")]
    parts = []
    if ratios:
        row, ratio = max(ratios, key=lambda pair: pair[1])
        parts.append(f"{_label(row)}: {speedup_text(row, ratio)}")
    parts += [f"{_label(r)}: {speedup_text(r, None)}" for r, _ in _against_eager(jobs)
              if r["status"] == "timeout" and not r.get("warm_cache_found")]
    return "; ".join(parts)


def warm_starts(jobs: dict[tuple[str, str], dict[str, Any]]) -> str:
    found = []
    for (phase, name), r in jobs.items():
        cold = jobs.get((phase, r.get("warm_from") or ""))
        if r["status"] == "ok" and r.get("warm_cache_found") and cold and cold["status"] == "ok" \
                and r.get("compile_seconds") is not None and cold.get("compile_seconds"):
            warm, cold_s = r["compile_seconds"], cold["compile_seconds"]
            found.append(f"{_label(r)}: {warm:.1f} s of {cold_s:.1f} s ({warm / cold_s:.0%}; "
                         "the cold one side by side)")
    return "; ".join(found)


def late_recompiles(jobs: dict[tuple[str, str], dict[str, Any]]) -> str:
    return "; ".join(
        f"{_label(r)}: {(r.get('late_recompiles') or 0) + (r.get('recompiles_after_first_pass') or 0)}"
        for r in jobs.values() if r["status"] == "ok" and r["kind"] == "train"
        and r.get("effective") and set(r["effective"].values()) != {"NONE"})


def memory_against_eager(jobs: dict[tuple[str, str], dict[str, Any]]) -> str:
    return "; ".join(
        f"{_label(r)}: {r['peak_reserved_bytes'] / eager['peak_reserved_bytes']:.2f}×"
        for r, eager in _against_eager(jobs) if r["status"] == "ok"
        and r.get("peak_reserved_bytes") and eager.get("peak_reserved_bytes"))


def regional_against_full(jobs: dict[tuple[str, str], dict[str, Any]]) -> str:
    """The rest phase's two compiled runs (`COMPILED`), each alone: cold compile and median
    step, REGIONAL against FULL. A FULL run killed at its limit still answers: its cold start
    took longer."""
    from modules.bench.gpu_context import COMPILED_NAME
    names = (f"train-sd15-{COMPILED_NAME}-alone", f"train-sd15-{COMPILED_NAME}-full")
    found = {name: r for (_, name), r in jobs.items() if name in names}
    regional, full = found.get(names[0]), found.get(names[1])
    if not regional or regional["status"] != "ok" or not full:
        return ""
    cold = regional.get("compile_seconds")
    if full["status"] == "timeout":
        return (f"REGIONAL {cold:.0f} s cold; FULL did not finish within {full['seconds']:.0f} s"
                if cold is not None else "")
    full_cold = full.get("compile_seconds")
    regional_step, full_step = (regional.get("median_step_seconds"),
                                full.get("median_step_seconds"))
    if full["status"] != "ok" or not full_cold or cold is None:
        return ""
    text = f"{cold:.0f} s vs {full_cold:.0f} s cold ({cold / full_cold:.2f})"
    if regional_step and full_step:
        text += f"; REGIONAL runs at {full_step / regional_step:.0%} of FULL's speed (median step)"
    return text + "; each alone"


# The engine's targets, as data: what each says, how it is read from the phases' rows, and
# the phase that answers it first (named while that phase has no results).
TARGETS: list[tuple[str, Callable[[dict[tuple[str, str], dict[str, Any]]], str], str]] = [
    ("best backend ≥ 1.5× eager steady-state step (SD 1.5 LoRA)", best_speedup,
     "1-sd15-headline"),
    ("REGIONAL cold start ≤ ¼ of FULL, with ≥ 90% of its speed",
     regional_against_full, "6-rest"),
    ("warm start ≤ 10% of cold (compile seconds)", warm_starts, "3-sd15-warm"),
    ("0 recompiles after warm-up, sampling included", late_recompiles, "2-sd15-breadth"),
    ("compiled peak reserved memory ≤ 1.1× eager", memory_against_eager, "1-sd15-headline"),
]


def target_lines(phases: list[dict[str, Any]]) -> list[str]:
    """The engine's targets against what the phases measured, honestly: "not measured" where
    a phase that answers it has not run."""
    jobs = _jobs(phases)
    rows = [[target, read(jobs) or f"not measured (phase {phase})"]
            for target, read, phase in TARGETS]
    return ["Targets (reported, not asserted):", "", *_table(["target", "measured"], rows)]


def plot_bars(phases: list[dict[str, Any]]) -> tuple[list[tuple[str, float]],
                                                     list[tuple[str, float]]]:
    """The plot's two sets of (label, value) bars: median step ms of the cells timed alone,
    and cold compile seconds of every run and cell that started from an empty cache (train
    runs and timed cells alike; one side by side is marked so: an upper bound)."""
    jobs = _jobs(phases)
    steps = [(_label(r), r["median_step_seconds"] * 1000) for r in jobs.values()
             if r["kind"] == "cell" and r["status"] == "ok" and r.get("median_step_seconds")
             and r.get("side_by_side", 1) == 1]
    cold = [(_label(r) + (" (side by side)" if r.get("side_by_side", 1) > 1 else ""),
             r["compile_seconds"]) for r in jobs.values()
            if r["kind"] in ("train", "cell") and r["status"] == "ok"
            and r.get("compile_seconds") and not r.get("warm_cache_found")]
    # a cold start killed at its limit is a lower bound, drawn as one (`> N s`)
    cold += [(f"{_label(r)} > {r['seconds']:.0f} s, killed", float(r["seconds"]))
             for r in jobs.values() if r["kind"] in ("train", "cell")
             and r["status"] == "timeout" and r.get("seconds") and not r.get("warm_cache_found")]
    return steps, cold


def write_plot(phases: list[dict[str, Any]], path: Path) -> bool:
    """Median step time (timed cells alone) and cold compile seconds (runs and cells)."""
    steps, cold = plot_bars(phases)
    if not steps and not cold:
        return False
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.8))
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    for axis, bars, color, title in (
            (left, steps, "tab:blue", "median step ms, alone (lower is better)"),
            (right, cold, "tab:red", "cold compile seconds (lower is better)")):
        drawn = axis.barh([label for label, _ in bars], [value for _, value in bars],
                          color=color)
        for bar, (label, _) in zip(drawn, bars):
            if label.endswith(", killed"):  # not an end: it ran at least this long
                bar.set_hatch("//")
                bar.set_alpha(0.5)
        axis.set_title(title)
        axis.tick_params(axis="y", labelsize=7)
    figure.suptitle(textwrap.fill(device_line(phases[0]), 130), fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return True
