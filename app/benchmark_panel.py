"""Advanced Options' "Benchmark…": a short side-by-side run of the current config, as a table.

The short version times eager against the backend picked in the panel (AOT_EAGER and DEFAULT
when the panel says NONE), a few steps each, each cell in its own process exactly as
``scripts/benchmark_compile.py`` does (both call `modules.bench.run_benchmark`). "Use fastest"
copies the winning cell's compile settings into the form; nothing is saved until the user saves.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import customtkinter as ctk

from app.binding import ConfigBinding
from app.labels import enum_label
from app.readable import readable
from app.text_boxes import pass_wheel_at_ends, set_readonly_text
from app.tooltip import Tooltip
from app.widgets import set_widget_enabled
from modules.config import Config, ConfigError, Problem
from modules.config.schema import CompileBackend

SHORT_STEPS, SHORT_WARMUP = 4, 3
POLL_MS = 100
BenchFn = Callable[..., Any]  # modules.bench.run_benchmark's signature


def short_backends(config: Config) -> list[str]:
    """Eager plus the chosen backend (plus the two cheapest when none is chosen)."""
    chosen = config.compile.backend.value
    return ["NONE", "AOT_EAGER", "DEFAULT"] if chosen == "NONE" else ["NONE", chosen]


def default_bench_fn() -> BenchFn:
    from modules.bench import run_benchmark  # torch is imported only when a benchmark starts
    return run_benchmark


def backend_names(values: list[str]) -> str:
    """Backends as the window's menu names them: "None (eager), Triton + CUDA graphs"."""
    return ", ".join(enum_label(CompileBackend(value)) for value in values)


def result_table(result: Any) -> str:
    """The result as an aligned plain-text table for the report box, and what the backend
    column's names (scripts/benchmark_compile.py's, kept so the columns line up) are in the
    window."""
    from modules.bench.report import plain_table
    shown = list(dict.fromkeys(cell["backend"] for cell in result.cells))
    legend = " · ".join(f"{value} = {enum_label(CompileBackend(value))}" for value in shown)
    return plain_table(result) + (f"\n{legend}\n" if legend else "")


def apply_refusal(result: Any) -> str | None:
    """Why "Use fastest" cannot apply `result` (a cell was stopped or timed out and may have
    been the fastest; no eager baseline), else None: the same rule as --apply."""
    from modules.bench.apply import ApplyError, recommended_settings
    try:
        recommended_settings(result)
    except ApplyError as exc:
        return str(exc)
    return None


class BenchmarkSection:
    """The button row, the live progress line and the result table, under the compile panel."""

    def __init__(self, parent: Any, binding: ConfigBinding,
                 show_problems: Callable[[list[Problem], str], None],
                 training_active: Callable[[], bool], bench_fn: BenchFn | None = None,
                 on_running: Callable[[bool], None] = lambda running: None) -> None:
        self.binding = binding
        self.on_running = on_running  # the window disables Start training meanwhile
        self.show_problems = show_problems
        self.training_active = training_active
        self.bench_fn = bench_fn
        self.events: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self.stop_requested = threading.Event()
        self.thread: threading.Thread | None = None
        self.result: Any = None
        self._poll_id: str | None = None

        row = ctk.CTkFrame(parent, fg_color="transparent")
        row.pack(fill="x", padx=10, pady=(4, 4))
        self.button = ctk.CTkButton(row, text="Benchmark…", width=160, command=self.start)
        self.button.pack(side="left")
        self.apply_button = ctk.CTkButton(row, text="Use fastest", width=120,
                                          command=self.use_fastest)
        self.apply_tip = Tooltip(self.apply_button, "")
        self._enable_apply(False, "no benchmark has run yet")
        self.apply_button.pack(side="left", padx=(8, 0))
        # Under the buttons, wrapped to the box's width: beside them a long refusal ran past
        # the window's edge.
        self.status = ctk.CTkLabel(parent, text="eager vs the chosen backend, a few steps "
                                                "each, on the current settings", anchor="w",
                                   justify="left", text_color=("gray35", "gray65"))
        self.status.pack(fill="x", padx=10, pady=(0, 4))
        self._wrap = 0
        parent.bind("<Configure>", lambda _e: self._fit_wrap(parent), add="+")
        self.table = ctk.CTkTextbox(parent, height=120, wrap="none",
                                    font=ctk.CTkFont(family="Courier", size=12))
        self.table.pack(fill="x", padx=10, pady=(0, 10))
        pass_wheel_at_ends(self.table)
        self._show("")

    def _fit_wrap(self, parent: Any) -> None:
        scale = parent._get_widget_scaling()
        wrap = max(200, int(parent.winfo_width() / scale) - 30)
        if wrap != self._wrap:
            self._wrap = wrap
            self.status.configure(wraplength=wrap)

    def _enable_apply(self, enabled: bool, why_not: str = "") -> None:
        set_widget_enabled(self.apply_button, enabled)
        self.apply_tip.text = "" if enabled else f"Not now: {why_not}"

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self) -> bool:
        """Validate the form, then benchmark a snapshot of it in a worker thread."""
        if self.running:
            self.stop_requested.set()  # the button reads "Stop" while a benchmark runs
            self.status.configure(text="stopping…")
            return False
        if self.training_active():
            self.status.configure(text="Stop training first: both would share the machine and "
                                       "the numbers would mean nothing.")
            return False
        problems = self.binding.problems(check_files=True)
        if problems:
            self.show_problems(problems, "Fix these before benchmarking")
            return False
        config = self.binding.snapshot()
        backends = short_backends(config)
        bench = self.bench_fn or default_bench_fn()
        self.stop_requested.clear()
        self.result = None
        self._enable_apply(False, "the benchmark is running")
        self.button.configure(text="Stop benchmark")
        self._show(f"Benchmarking {backend_names(backends)} on the current settings: each cell "
                   "is a fresh process that compiles and trains a few steps.")

        def work() -> None:
            try:
                result = bench(config, backends=backends, steps=SHORT_STEPS,
                               warmup=SHORT_WARMUP, warm_start=False,
                               progress=lambda e: self.events.put(("progress", e)),
                               should_stop=self.stop_requested.is_set)
                self.events.put(("done", result))
            except ConfigError as exc:
                self.events.put(("problems", exc.problems))
            except Exception as exc:  # shown in the box, never swallowed
                self.events.put(("failed", f"{type(exc).__name__}: {exc}"))

        self.thread = threading.Thread(target=work, name="tempera-benchmark", daemon=True)
        self.thread.start()
        self.on_running(True)
        self._poll_id = self.button.after(POLL_MS, self._poll)
        return True

    def stop(self) -> None:
        """Ask a running benchmark to kill its cell (window closing)."""
        self.stop_requested.set()
        if self._poll_id is not None:
            self.button.after_cancel(self._poll_id)
            self._poll_id = None

    def _poll(self) -> None:
        self._poll_id = None
        while True:
            try:
                kind, data = self.events.get_nowait()
            except queue.Empty:
                break
            self._handle(kind, data)
        if self.running or not self.events.empty():
            self._poll_id = self.button.after(POLL_MS, self._poll)
        else:
            self.button.configure(text="Benchmark…")
            self.on_running(False)

    def _handle(self, kind: str, data: Any) -> None:
        if kind == "progress":
            self.status.configure(text=readable(f"[{data.index}/{data.total}] {data.cell}: "
                                                f"{data.message}"))
        elif kind == "done":
            self.result = data
            self._show(result_table(data))
            refusal = apply_refusal(data)
            self._enable_apply(refusal is None, readable(refusal or ""))
            self.status.configure(text=readable(self.summary(data)) if refusal is None else
                                  f"Use fastest cannot apply this: {readable(refusal)}")
        elif kind == "problems":
            self.show_problems(data, "Fix these before benchmarking")
            self._show(f"Cannot benchmark: {len(data)} problem(s), listed below the tabs.")
        else:
            self._show(f"The benchmark failed: {data}")
            self.status.configure(text="benchmark failed")
            self._enable_apply(False, "the benchmark failed")

    @staticmethod
    def summary(result: Any) -> str:
        fastest = result.fastest()
        if fastest is None:
            return "no compiled cell ran cleanly; see the table"
        if (fastest.get("speedup") or 0) <= 1.0:
            return f"eager was fastest here ({fastest['label']}: {fastest['speedup']}× eager)"
        return f"fastest: {fastest['label']}, {fastest['speedup']:.2f}× eager"

    def use_fastest(self) -> None:
        """Copy the recommended compile settings into the form (the same rule as --apply)."""
        from modules.bench.apply import ApplyError, recommended_settings
        try:
            values, note, _ = recommended_settings(self.result)
        except ApplyError as exc:
            self.status.configure(text=str(exc))
            return
        for path, value in values.items():
            self.binding.set_value(path, value)
        self.status.configure(text=f"Backend set to {enum_label(values['compile.backend'])} "
                                   f"({readable(note)}); save the preset to keep it")

    def _show(self, text: str) -> None:
        set_readonly_text(self.table, text)

    def text(self) -> str:
        return self.table.get("1.0", "end-1c")
