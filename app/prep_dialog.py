"""The Data tab's *Caption images…* and *Make masks…*: one window per preparation tool.

The tool is a row of the engine's table (`modules.data.prep.tools.PREP_TOOLS`): its settings
(a dataclass whose fields carry their help and choices), its presets and the function that runs
it over a folder. This window is built from that row alone: a folder, a preset, one input per
setting (a menu for a choice, a box for a yes/no, an entry for the rest, the field's help as its
tooltip), then Start / Stop, a progress bar with the count and the time left, the job's status
lines and, at the end, its report (what was written, left alone, skipped or failed, by name).

The job runs on a thread of its own; its progress and status reach the window through a queue
the window reads on its own thread. Stop asks the job to end after the batch in progress (every
file it wrote is whole; the same job again continues where it stopped). Closing the window while
a job runs stops it first. A job does not start while a training run is running (the caption or
mask model would share the device with it): the window says so.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import customtkinter as ctk

from app.dialogs import ask_directory
from app.text_boxes import set_readonly_text
from app.tooltip import Tooltip
from app.widgets import set_widget_enabled
from modules.frontend import format_duration

POLL_MS = 100
NO_PRESET = "(none: the settings below)"


def progress_line(progress: Any) -> str:
    """One line for the job's progress: the count, what went wrong so far, the time left."""
    line = f"{progress.done} of {progress.total} images"
    extra = [f"{n} {what}" for n, what in ((progress.failed, "failed"),
                                           (progress.skipped, "unreadable")) if n]
    if extra:
        line += f" ({', '.join(extra)})"
    if progress.done < progress.total:
        line += (" · estimating the time left" if progress.eta_seconds is None
                 else f" · {format_duration(progress.eta_seconds)} left")
    return line


class PrepDialog(ctk.CTkToplevel):
    """One preparation tool's window (see the module docstring)."""

    def __init__(self, parent: Any, tool: Any, folder: str = "",
                 busy_reason: Callable[[], str | None] = lambda: None,
                 on_done: Callable[[Any], None] = lambda _report: None) -> None:
        super().__init__(parent)
        self.tool = tool
        self.busy_reason, self.on_done = busy_reason, on_done
        self.title(tool.title)
        self.results: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.stop_event: threading.Event | None = None
        self.thread: threading.Thread | None = None
        self.report: Any = None
        self.grid_columnconfigure(1, weight=1)

        row = 0
        ctk.CTkLabel(self, text="Folder", anchor="w").grid(row=row, column=0, sticky="w",
                                                           padx=(16, 8), pady=(16, 4))
        self.folder = ctk.CTkEntry(self, width=420)
        self.folder.insert(0, folder)
        self.folder.grid(row=row, column=1, sticky="ew", pady=(16, 4))
        ctk.CTkButton(self, text="Browse…", width=80, command=self.browse).grid(
            row=row, column=2, padx=(8, 16), pady=(16, 4))

        row += 1
        self.preset = ctk.StringVar(value=NO_PRESET)
        if tool.presets:
            ctk.CTkLabel(self, text="Preset", anchor="w").grid(row=row, column=0, sticky="w",
                                                               padx=(16, 8), pady=4)
            names = [NO_PRESET, *tool.presets]
            self.preset_menu = ctk.CTkOptionMenu(self, values=names, variable=self.preset,
                                                 command=self.apply_preset, width=220)
            self.preset_menu.grid(row=row, column=1, sticky="w", pady=4)
            self.preset_summary = ctk.CTkLabel(self, text="", anchor="w", justify="left",
                                               wraplength=520, text_color="gray50")
            row += 1
            self.preset_summary.grid(row=row, column=1, columnspan=2, sticky="w", pady=(0, 4))
        row += 1

        self.inputs: dict[str, Any] = {}
        self.variables: dict[str, Any] = {}
        settings_frame = ctk.CTkScrollableFrame(self, height=260)
        settings_frame.grid(row=row, column=0, columnspan=3, sticky="nsew", padx=16, pady=4)
        settings_frame.grid_columnconfigure(1, weight=1)
        self.grid_rowconfigure(row, weight=1)
        for line, f in enumerate(dataclasses.fields(tool.settings_type)):
            label = ctk.CTkLabel(settings_frame, text=tool.label(f.name), anchor="w")
            label.grid(row=line, column=0, sticky="w", padx=(0, 8), pady=2)
            widget = self._input(settings_frame, f)
            widget.grid(row=line, column=1, sticky="w", pady=2)
            Tooltip(label, f.metadata.get("help", ""))
            Tooltip(widget, f.metadata.get("help", ""))
            self.inputs[f.name] = widget
        row += 1

        self.progress_bar = ctk.CTkProgressBar(self)
        self.progress_bar.set(0)
        self.progress_bar.grid(row=row, column=0, columnspan=3, sticky="ew", padx=16,
                               pady=(8, 2))
        row += 1
        self.progress_text = ctk.CTkLabel(self, text="", anchor="w")
        self.progress_text.grid(row=row, column=0, columnspan=3, sticky="w", padx=16)
        row += 1
        self.output = ctk.CTkTextbox(self, height=140, wrap="word")
        self.output.grid(row=row, column=0, columnspan=3, sticky="nsew", padx=16, pady=4)
        self.output.configure(state="disabled")
        row += 1
        buttons = ctk.CTkFrame(self, fg_color="transparent")
        buttons.grid(row=row, column=0, columnspan=3, sticky="e", padx=16, pady=(4, 16))
        self.start_button = ctk.CTkButton(buttons, text="Start", width=90, command=self.start)
        self.stop_button = ctk.CTkButton(buttons, text="Stop", width=90, command=self.stop)
        self.close_button = ctk.CTkButton(buttons, text="Close", width=90, command=self.close)
        for button in (self.start_button, self.stop_button, self.close_button):
            button.pack(side="left", padx=(8, 0))
        set_widget_enabled(self.stop_button, False)
        self.protocol("WM_DELETE_WINDOW", self.close)
        self.show_settings(tool.defaults())

    # -- the settings ---------------------------------------------------------------------------
    def _input(self, parent: Any, f: dataclasses.Field) -> Any:
        choices = f.metadata.get("choices")
        if choices:
            variable = ctk.StringVar()
            self.variables[f.name] = variable
            return ctk.CTkOptionMenu(parent, values=[str(c) for c in choices],
                                     variable=variable, width=220)
        if f.type in ("bool", bool):
            variable = ctk.BooleanVar()
            self.variables[f.name] = variable
            return ctk.CTkCheckBox(parent, text="", variable=variable, width=24)
        return ctk.CTkEntry(parent, width=420 if f.type in ("str", str) else 140)

    def show_settings(self, settings: Any) -> None:
        """Put `settings`' values into the inputs."""
        for f in dataclasses.fields(settings):
            value = getattr(settings, f.name)
            if f.name in self.variables:
                self.variables[f.name].set(value if isinstance(value, bool) else str(value))
            else:
                entry = self.inputs[f.name]
                entry.delete(0, "end")
                entry.insert(0, self.tool.text(value))

    def typed(self) -> dict[str, str | bool]:
        """What the user typed or picked, per setting (parsed by the engine)."""
        values: dict[str, str | bool] = {}
        for name, widget in self.inputs.items():
            values[name] = self.variables[name].get() if name in self.variables \
                else widget.get()
        return values

    def apply_preset(self, name: str) -> None:
        if name == NO_PRESET:
            self.preset_summary.configure(text="")
            return
        self.preset_summary.configure(text=self.tool.presets[name])
        self.show_settings(self.tool.preset(name))

    def browse(self) -> None:
        chosen = ask_directory(self, f"{self.tool.title}: the images' folder", self.folder.get())
        if chosen:
            self.folder.delete(0, "end")
            self.folder.insert(0, chosen)

    # -- the job --------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def say(self, text: str) -> None:
        set_readonly_text(self.output, text)

    def add_line(self, text: str) -> None:
        self.output.configure(state="normal")
        self.output.insert("end", ("\n" if self.output.get("1.0", "end").strip() else "")
                           + text)
        self.output.see("end")
        self.output.configure(state="disabled")

    def start(self) -> None:
        if self.running:
            return
        busy = self.busy_reason()
        if busy:
            self.say(f"Not started: {busy}.")
            return
        try:
            settings = self.tool.settings(self.typed())
        except ValueError as error:  # a setting that cannot be read, named by its label
            self.say(f"Not started: {error}")
            return
        folder = Path(self.folder.get().strip()).expanduser()
        if not self.folder.get().strip():
            self.say("Not started: choose the folder of images first.")
            return
        self.report = None
        self.say("")
        self.progress_bar.set(0)
        self.progress_text.configure(text="starting…")
        self.stop_event = threading.Event()
        hooks = self.tool.hooks(progress=lambda p: self.results.put(("progress", p)),
                                status=lambda text: self.results.put(("status", text)))
        stop = self.stop_event

        def work() -> None:
            try:
                self.results.put(("done", self.tool.run(folder, settings, hooks, stop)))
            except self.tool.refused as error:  # refused before anything was written
                self.results.put(("refused", str(error)))
            except Exception as error:  # anything else is shown, never swallowed
                self.results.put(("failed", f"{type(error).__name__}: {error}"))

        self.thread = threading.Thread(target=work, name=f"tempera-{self.tool.key}",
                                       daemon=True)
        set_widget_enabled(self.start_button, False)
        set_widget_enabled(self.stop_button, True)
        self.thread.start()
        self.after(POLL_MS, self._poll)

    def stop(self) -> None:
        if self.stop_event is not None and self.running:
            self.stop_event.set()
            set_widget_enabled(self.stop_button, False)
            self.add_line("Stopping after the batch in progress…")

    def close(self) -> None:
        """Close; a running job is stopped first (the window closes when it has ended)."""
        if self.running:
            self.stop()
            self.after(POLL_MS, self.close)
            return
        self.destroy()

    def _poll(self) -> None:
        ended = None
        while True:
            try:
                kind, value = self.results.get_nowait()
            except queue.Empty:
                break
            if kind == "progress":
                self.progress_bar.set(value.done / value.total if value.total else 1)
                self.progress_text.configure(text=progress_line(value))
            elif kind == "status":
                self.add_line(value)
            else:
                ended = (kind, value)
        if ended is None:
            if self.winfo_exists():
                self.after(POLL_MS, self._poll)
            return
        kind, value = ended
        set_widget_enabled(self.start_button, True)
        set_widget_enabled(self.stop_button, False)
        if kind == "done":
            self.report = value
            self.progress_text.configure(text=value.lines()[0])
            self.add_line("\n".join(value.lines()))
            self.on_done(value)
        else:
            self.progress_text.configure(text="Not started" if kind == "refused" else "Failed")
            self.add_line(("Not started: " if kind == "refused" else "Failed: ") + value)
