"""*Check compilation* (Advanced Options): trace the model once in a worker thread and show
what compiled, while Start waits (both would share dynamo's process-wide state)."""
from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from app.binding import ConfigBinding
from app.compile_info import format_report
from app.labels import enum_label
from app.runner import run_in_thread
from modules import frontend
from modules.config import Config, ConfigError


class CompileCheck:
    def __init__(self, binding: ConfigBinding, panel: Any, problems: Any, runs: Any,
                 run_panel: Any, events: "queue.Queue[Any]",
                 explain_fn: Callable[[Config], Any] | None = None) -> None:
        self.binding, self.panel, self.problems, self.runs = binding, panel, problems, runs
        self.run_panel, self.events = run_panel, events
        self.explain = explain_fn or frontend.explain

    def start(self) -> None:
        """The button: fields with errors are listed instead; otherwise the check runs in a
        worker and its report arrives as a "report" event (`show_report`)."""
        unfit = self.binding.field_problems()
        if unfit:
            self.problems.show(unfit, "Fix these fields first", source=self.binding.field_problems)
            return
        if self.runs.training or self.runs.checking:
            return
        config = self.binding.snapshot()
        # Both would share dynamo's process-wide state: the check resets it and compiles
        self.runs.block_start("check", "Check compilation is running (Advanced Options): "
                                       "wait for its report")
        self.panel.show_report(f"Checking {enum_label(config.compile.backend)}… (this traces the "
                               "model once; it can take a while)")
        run_in_thread(lambda: self.explain(config), self.events, "report")

    def show_report(self, ok: bool, value: Any) -> None:
        self.runs.block_start("check", None)
        if not ok and isinstance(value, ConfigError):
            self.problems.show(value.problems)
            text = f"Cannot check: {len(value.problems)} problem(s), listed below the tabs."
        elif not ok:
            text = f"The check failed:\n{getattr(value, 'formatted_traceback', value)}"
        else:
            text = format_report(value)
        self.panel.show_report(text, result=True)
        self.run_panel.log("compilation check " + ("done" if ok else "failed"))
