"""The benchmark's outputs: machine description, benchmark.json, benchmark.md, benchmark.png."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any

from modules.util.atomic import atomic_write_text

MIB = 1024 * 1024


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on; the load average matters on a shared machine."""
    import torch

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda_version": torch.version.cuda,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _num(value: Any, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _row(cell: dict[str, Any]) -> list[str]:
    warm = cell.get("warm") or {}
    memory = cell.get("peak_memory_bytes")
    notes = cell.get("error") or "; ".join(cell.get("fallbacks") or []) or ""
    if cell["status"] != "ok":
        notes = f"**{cell['status']}**: {notes}"
    warm_text = "—"
    if warm.get("status") == "ok":
        warm_text = f"{_num(warm.get('cold_start_seconds'), '.1f')} (cache {warm['cache']})"
    elif warm:
        warm_text = f"{warm.get('status')}: {warm.get('error')}"
    baseline = cell["backend"] == "NONE"
    return [
        cell["backend"], cell["components"], cell["scope"], cell["dynamic"],
        _num(cell.get("median_step_seconds") and cell["median_step_seconds"] * 1000, ".1f"),
        _num(cell.get("speedup"), ".2f"),
        "—" if baseline else _num(cell.get("cold_start_seconds"), ".1f"),
        "—" if baseline else _num(cell.get("compile_seconds"), ".1f"),
        warm_text,
        _num(memory and memory / MIB, ".0f"),
        _num(cell.get("recompiles"), "d"),
        _num(cell.get("graphs_after_warmup"), "d"),
        _num(cell.get("graph_breaks"), "d"),
        notes.replace("|", "\\|"),
    ]


HEADER = ["backend", "components", "scope", "dynamic", "step ms (median)", "speedup",
          "cold start s", "compile s", "warm start s", "peak MiB",
          "recompiles", "new graphs after warm-up", "graph breaks", "notes"]


def markdown_table(cells: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_row(cell)) + " |" for cell in cells]
    return "\n".join(lines)


PLAIN_COLUMNS = (("backend", 0), ("components", 1), ("scope", 2), ("dynamic", 3),
                 ("step ms", 4), ("speedup", 5), ("cold start s", 6), ("notes", 13))


def plain_table(result) -> str:
    """The main columns as an aligned text table (the GUI's report box is not Markdown)."""
    rows = [[name for name, _ in PLAIN_COLUMNS]]
    rows += [[_row(cell)[i] for _, i in PLAIN_COLUMNS] for cell in result.cells]
    widths = [max(len(r[i]) for r in rows) for i in range(len(PLAIN_COLUMNS) - 1)]
    lines = ["  ".join(value.ljust(w) for value, w in zip(row, widths)) + "  "
             + row[-1].replace("**", "").replace("\\|", "|")
             for row in rows]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def markdown_report(result) -> str:
    """The table plus the settings and machine it came from, as one Markdown block."""
    m, s = result.machine, result.settings
    device = m.get("cuda_device") or f"CPU {m['cpu']}, {m['cpu_cores']} cores"
    load = m.get("load_average_start")
    memory_kind = next((c.get("peak_memory_kind") for c in result.cells
                        if c.get("peak_memory_kind")), "peak_rss")
    fastest = result.fastest()
    lines = [
        f"Model `{s.get('model', s['model_path'])}` ({s['model_type']}), {s['resolution']} px, "
        f"batch {s['batch_size']}, {s['method']}, mixed precision {s['mixed_precision']}; "
        f"{s['warmup']} warm-up + {s['steps']} timed steps per cell.",
        f"Device: {device}; torch {m['torch']}; {m['date']}"
        + (f"; load average at start {load[0]:.2f}" if load else "") + ".",
        "",
        markdown_table(result.cells),
        "",
        f"Step time is the median of the timed steps (first step and warm-up excluded); speedup "
        f"is the NONE cell's median divided by the cell's, from this run. Cold start is the "
        f"cell's first step minus the eager median step, in a fresh process with an empty "
        f"compile cache; compile s is the part of it the engine spent compiling; warm start is "
        f"the cold start of the same cell in a second process that finds the cache the first "
        f"one filled. Peak memory: "
        f"{'CUDA max allocated' if memory_kind == 'cuda_max_allocated' else 'peak RSS of the cell process'}.",
        "",
        ("Fastest working compiled cell: "
         f"**{fastest['label']}** ({fastest['speedup']:.2f}× eager)." if fastest and
         fastest.get("speedup") else "No compiled cell ran its requested backend cleanly."),
    ]
    return "\n".join(lines) + "\n"


def write_plot(result, path: Path) -> None:
    """Speedup and compile time per cell, two bar charts side by side (Agg, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells = [c for c in result.cells if c["status"] == "ok"]
    labels = [c["label"].replace(" ", "\n", 1) for c in cells]
    figure = Figure(figsize=(max(8.0, 1.6 * len(cells) * 2), 4.8))
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    positions = list(range(len(cells)))
    left.bar(positions, [c.get("speedup") or 0 for c in cells], color="tab:blue")
    left.axhline(1.0, color="grey", linewidth=1, linestyle="--")
    left.set_title("speedup vs eager (higher is better)")
    cold = [c.get("cold_start_seconds") or 0 for c in cells]
    warm = [(c.get("warm") or {}).get("cold_start_seconds") or 0 for c in cells]
    width = 0.4
    right.bar([p - width / 2 for p in positions], cold, width, label="cold", color="tab:red")
    right.bar([p + width / 2 for p in positions], warm, width, label="warm (cache)",
              color="tab:green")
    right.set_title("cold start seconds (lower is better)")
    right.legend()
    for axis in (left, right):
        axis.set_xticks(positions)
        axis.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    s = result.settings
    figure.suptitle(f"{s.get('model', s['model_type'])}, {s['resolution']} px, batch "
                    f"{s['batch_size']}, {s['method']} — "
                    f"{result.machine.get('cuda_device') or result.machine['cpu']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def write_outputs(result, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "benchmark.json", "markdown": out_dir / "benchmark.md",
             "png": out_dir / "benchmark.png"}
    atomic_write_text(paths["json"], json.dumps(result.to_json(), indent=2) + "\n")
    atomic_write_text(paths["markdown"], result.markdown())
    write_plot(result, paths["png"])
    return paths
