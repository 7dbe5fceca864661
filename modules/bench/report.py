"""The benchmark's outputs: machine description, benchmark.json, benchmark.md, benchmark.png."""
from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
from pathlib import Path
from typing import Any

from modules.util.atomic import atomic_write_text
from modules.util.cores import usable_cores

MIB = 1024 * 1024


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def torch_build() -> dict[str, str | None]:
    """torch's version string (with its build, "+cu130") and CUDA version, read from its
    ``torch/version.py`` without importing torch (seconds of a process's start)."""
    spec = importlib.util.find_spec("torch")  # a top-level package: not imported by this
    if spec is None or spec.origin is None:
        return {"torch": None, "cuda": None}
    version_file = importlib.util.spec_from_file_location(
        "_tempera_torch_version", Path(spec.origin).parent / "version.py")
    if version_file is None or version_file.loader is None:
        return {"torch": None, "cuda": None}
    module = importlib.util.module_from_spec(version_file)
    version_file.loader.exec_module(module)
    return {"torch": module.__version__, "cuda": module.cuda}


def machine_info(ask_cuda: bool = True) -> dict[str, Any]:
    """What the numbers were measured on; the load average matters on a shared machine.

    ``ask_cuda`` False leaves ``cuda_device`` None and ``torch_threads`` out, and does not
    import torch at all: asking for the GPU's name creates a CUDA context, which a parent
    process that only starts and watches jobs must not hold, and importing torch costs it
    seconds (the GPU validation's env job reads the name and the threads instead)."""
    info: dict[str, Any] = {"cpu": cpu_model(), "cpu_cores": usable_cores()}
    if ask_cuda:
        import torch
        info.update(torch_threads=torch.get_num_threads(), torch=torch.__version__,
                    cuda_device=(torch.cuda.get_device_name(0) if torch.cuda.is_available()
                                 else None),
                    cuda_version=torch.version.cuda)
    else:
        build = torch_build()
        info.update(torch=build["torch"], cuda_device=None, cuda_version=build["cuda"])
    info.update(python=platform.python_version(), platform=platform.platform(),
                date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _num(value: Any, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def measured_on_cuda(cells: list[dict[str, Any]]) -> bool:
    """Whether the cells carry CUDA allocator peaks (else only the process's RSS exists)."""
    return any(c.get("peak_reserved_bytes") is not None for c in cells)


def memory_columns(cuda: bool) -> list[str]:
    return ["peak allocated MiB", "peak reserved MiB"] if cuda else ["peak RSS MiB"]


def _mib(value: Any) -> str:
    return _num(value if value is None else value / MIB, ".0f")


def _row(cell: dict[str, Any], cuda: bool) -> dict[str, str]:
    """One table row, keyed by column name."""
    warm = cell.get("warm") or {}
    notes = cell.get("error") or "; ".join(cell.get("fallbacks") or []) or ""
    if cell["status"] != "ok":
        notes = f"**{cell['status']}**: {notes}"
    warm_text = "—"
    if warm.get("status") == "ok":
        warm_text = f"{_num(warm.get('cold_start_seconds'), '.1f')} (cache {warm['cache']})"
    elif warm:
        warm_text = f"{warm.get('status')}: {warm.get('error')}"
    baseline = cell["backend"] == "NONE"
    median = cell.get("median_step_seconds")
    timed = cell.get("timed_steps")
    row = {
        "backend": cell["backend"], "components": cell["components"], "scope": cell["scope"],
        "dynamic": cell["dynamic"],
        "step ms (median)": _num(median and median * 1000, ".1f"),
        "timed steps": "—" if timed is None else str(len(timed)),
        "speedup": _num(cell.get("speedup"), ".2f"),
        "cold start s": "—" if baseline else _num(cell.get("cold_start_seconds"), ".1f"),
        "compile s": "—" if baseline else _num(cell.get("compile_seconds"), ".1f"),
        "warm start s": warm_text,
    }
    if cuda:
        row["peak allocated MiB"] = _mib(cell.get("peak_allocated_bytes"))
        row["peak reserved MiB"] = _mib(cell.get("peak_reserved_bytes"))
    else:
        row["peak RSS MiB"] = _mib(cell.get("peak_rss_bytes"))
    row.update({
        "recompiles": _num(cell.get("recompiles"), "d"),
        "new graphs after warm-up": _num(cell.get("graphs_after_warmup"), "d"),
        "graph breaks": _num(cell.get("graph_breaks"), "d"),
        "notes": notes.replace("|", "\\|"),
    })
    return row


def header(cuda: bool) -> list[str]:
    return ["backend", "components", "scope", "dynamic", "step ms (median)", "timed steps",
            "speedup", "cold start s", "compile s", "warm start s", *memory_columns(cuda),
            "recompiles", "new graphs after warm-up", "graph breaks", "notes"]


def markdown_table(cells: list[dict[str, Any]]) -> str:
    cuda = measured_on_cuda(cells)
    names = header(cuda)
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(_row(cell, cuda)[n] for n in names) + " |" for cell in cells]
    return "\n".join(lines)


PLAIN_COLUMNS = ("backend", "components", "scope", "dynamic", "step ms (median)", "speedup",
                 "cold start s", "notes")


def plain_table(result) -> str:
    """The main columns as an aligned text table (the GUI's report box is not Markdown)."""
    cuda = measured_on_cuda(result.cells)
    rows = [["step ms" if n == "step ms (median)" else n for n in PLAIN_COLUMNS]]
    rows += [[_row(cell, cuda)[n] for n in PLAIN_COLUMNS] for cell in result.cells]
    widths = [max(len(r[i]) for r in rows) for i in range(len(PLAIN_COLUMNS) - 1)]
    lines = ["  ".join(value.ljust(w) for value, w in zip(row, widths)) + "  "
             + row[-1].replace("**", "").replace("\\|", "|")
             for row in rows]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _how_measured(result) -> str:
    cuda = measured_on_cuda(result.cells)
    timing = ("each later step is the time between two CUDA events recorded at optimizer-step "
              "ends, read after one synchronize at the end of the run" if cuda else
              "each later step is timed with time.perf_counter")
    memory = ("peak allocated and peak reserved memory of torch's CUDA caching allocator over "
              "the cell process (reserved includes the private pools CUDA graphs keep)" if cuda
              else "the cell process's peak RSS (torch keeps no allocated/reserved counters on "
              "the CPU)")
    return (f"Step time is the median of the timed steps: the first {result.settings['warmup']} "
            "step(s), every step that compiled and, with CUDA graphs, the steps that warm up "
            f"and record them are left out; {timing}. Speedup is the NONE cell's median divided "
            "by the cell's, from this run. Cold start is the cell's first step minus the eager "
            "median step, in a fresh process with an empty compile cache; compile s is the part "
            "of it the engine spent compiling; warm start is the cold start of the same cell in "
            "a second process that finds the cache the first one filled. Peak memory: "
            f"{memory}.")


def markdown_report(result) -> str:
    """The table plus the settings and machine it came from, as one Markdown block."""
    m, s = result.machine, result.settings
    device = (m.get("cuda_device") if measured_on_cuda(result.cells) else None) or \
        f"CPU {m['cpu']}, {m['cpu_cores']} cores"
    load = m.get("load_average_start")
    fastest = result.fastest()
    lines = [
        f"Model `{s.get('model', s['model_path'])}` ({s['model_type']}), {s['resolution']} px, "
        f"batch {s['batch_size']}, {s['method']}, mixed precision {s['mixed_precision']}, "
        f"frozen weights {s['weight_dtype']}; {s['warmup']} warm-up step(s), then {s['steps']} "
        "timed steps per cell (steps that compiled are not timed).",
        f"Device: {device}; torch {m['torch']}; {m['date']}"
        + (f"; load average at start {load[0]:.2f}" if load else "") + ".",
        "",
        markdown_table(result.cells),
        "",
        _how_measured(result),
        "",
        ("Fastest working compiled cell: "
         f"**{fastest['label']}** ({fastest['speedup']:.2f}× eager)." if fastest and
         fastest.get("speedup") else "No compiled cell ran its requested backend cleanly."),
    ]
    unfinished = [c["label"] for c in result.cells if c["status"] in ("timeout", "skipped")]
    if unfinished:
        lines.append(f"Not finished (not compared): {', '.join(unfinished)}.")
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
