"""The LoRA tools tab: merge, merge several, extract, resize, convert (docs/lora_tools.md).

A form over `frontend.lora_tool`: the tool runs in a thread (it reads whole models), its
progress (a line per layer of resize and extract), report or error comes back through a queue
the Tk thread polls with `after()`. A refusal names the field to change by its label here
(`LABELS`), as the command line names it by its flag.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import customtkinter as ctk

from app.dialogs import ask_directory, ask_open_file, ask_save_file, start_folder
from app.text_boxes import set_readonly_text
from app.widgets import set_widget_enabled
from modules import frontend

TAB = "LoRA tools"
TOOLS = {  # label -> (tool, the fields it reads)
    "Merge LoRAs into a model": ("merge", ("base", "config_folder", "loras", "output")),
    "Merge LoRAs into one": ("merge-loras", ("base", "config_folder", "model_type", "loras",
                                             "layout", "output")),
    "Extract a LoRA (two models)": ("extract", ("base", "config_folder", "tuned", "rank",
                                                "conv_rank", "layout", "output")),
    "Resize a LoRA": ("resize", ("base", "config_folder", "model_type", "loras", "rank",
                                 "layout", "output")),
    "Convert a LoRA's layout": ("convert", ("base", "config_folder", "model_type", "loras",
                                            "layout", "output")),
}
FIELDS = {  # field -> (label, hint)
    "base": ("Base model", "a diffusers folder, a .safetensors checkpoint, or "
                           f"{frontend.BUILTIN_DEMO} (the demo's)"),
    "config_folder": ("Config folder", "a .safetensors base's architecture: a diffusers folder "
                                       "of it (empty: the shipped configs)"),
    "tuned": ("Fine-tuned model", "the model the LoRA is taken from"),
    "rank": ("Rank", "the LoRA's rank"),
    "conv_rank": ("Conv rank", "convolutions' rank (0: left out)"),
    "output": ("Output", "a new .safetensors LoRA file (never overwritten)"),
}
# what a field asks for where it differs by tool: (tool, field) -> hint or label
HINTS = {
    ("merge", "output"): "a new folder (diffusers) or .safetensors (one file); never "
                         "overwritten; the base is not changed",
    ("resize", "rank"): "the new, lower rank",
}
LORAS_LABEL = {"merge": "LoRA files\n(one per line,\nfile:weight)",
               "merge-loras": "LoRA files\n(one per line,\nfile:weight)",
               "resize": "LoRA file", "convert": "LoRA file"}
# each input a tool's refusal names (modules/lora_tools/errors.py), in this tab's words
LABELS = {**{name: label for name, (label, _) in FIELDS.items()},
          "loras": "LoRA files", "layout": "LoRA layout written", "model_type": "Model type",
          "cache_dir": "the Cache folder setting (General)", "threshold": "Threshold"}
SAFETENSORS: tuple[str, tuple[str, ...]] = ("Safetensors", ("*.safetensors",))
# the Browse buttons beside each path field: a folder ("folder"), an existing .safetensors
# ("file") or a new path to write ("save")
BROWSE = {"base": ("folder", "file"), "config_folder": ("folder",),
          "tuned": ("folder", "file"), "output": ("save",)}
BROWSE_TEXT = {"folder": "Folder…", "file": "File…", "save": "Save as…"}
LAYOUTS = ("kohya", "diffusers")
# without a base model, the family's shipped architecture names the layers
MODEL_TYPES = {"from the base model": None, **{spec.short_label: model_type.cli_name
                                               for model_type, spec in frontend.MODEL_TYPES.items()}}
POLL_MS = 100


class LoraToolsPanel:
    """The tab's widgets and the one tool run at a time."""

    def __init__(self, parent: Any, tool_fn: Callable[..., str] = frontend.lora_tool,
                 cache_dir: Callable[[], str] = lambda: "") -> None:
        self.tool_fn = tool_fn
        self.cache_dir = cache_dir  # the settings' Cache folder, where builtin: models are built
        # (state, text): "progress" while running, then "done", "refused" or "failed"
        self.results: "queue.Queue[tuple[str, str]]" = queue.Queue()
        self.busy = False
        self.ok: bool | None = None  # how the last run ended
        self.frame = ctk.CTkScrollableFrame(parent, fg_color="transparent")
        self.frame.pack(fill="both", expand=True)
        self.frame.grid_columnconfigure(1, weight=1)
        ctk.CTkLabel(self.frame, text="Tool").grid(row=0, column=0, sticky="w", padx=6, pady=3)
        self.tool = ctk.CTkOptionMenu(self.frame, values=list(TOOLS),
                                      command=lambda _: self._show_fields())
        self.tool.grid(row=0, column=1, sticky="w", padx=6, pady=3)
        self.entries: dict[str, ctk.CTkEntry] = {}
        self.rows: dict[str, list[Any]] = {}
        self.browse: dict[tuple[str, str], ctk.CTkButton] = {}  # (field, kind) -> its button
        for row, (name, (label, hint)) in enumerate(FIELDS.items(), start=1):
            text = ctk.CTkLabel(self.frame, text=label)
            entry = ctk.CTkEntry(self.frame, placeholder_text=hint)
            text.grid(row=row, column=0, sticky="w", padx=6, pady=3)
            entry.grid(row=row, column=1, sticky="ew", padx=6, pady=3)
            self.entries[name], self.rows[name] = entry, [text, entry]
            if name in BROWSE:
                self.rows[name].append(self._browse_buttons(name, BROWSE[name], row))
        self.entries["rank"].insert(0, "16")
        self.entries["conv_rank"].insert(0, "0")
        row = len(FIELDS) + 1
        loras_label = ctk.CTkLabel(self.frame, text=LORAS_LABEL["merge"], justify="left")
        self.loras_label = loras_label
        loras_label.grid(row=row, column=0, sticky="nw", padx=6, pady=3)
        self.loras = ctk.CTkTextbox(self.frame, height=70)
        self.loras.grid(row=row, column=1, sticky="ew", padx=6, pady=3)
        add = ctk.CTkButton(self.frame, text="Add file…", width=80, command=self.add_lora_file)
        add.grid(row=row, column=2, sticky="nw", padx=6, pady=3)
        self.browse[("loras", "file")] = add
        self.rows["loras"] = [loras_label, self.loras, add]
        layout_label = ctk.CTkLabel(self.frame, text="LoRA layout written")
        layout_label.grid(row=row + 1, column=0, sticky="w", padx=6, pady=3)
        self.layout = ctk.CTkOptionMenu(self.frame, values=list(LAYOUTS))
        self.layout.grid(row=row + 1, column=1, sticky="w", padx=6, pady=3)
        self.rows["layout"] = [layout_label, self.layout]
        type_label = ctk.CTkLabel(self.frame, text="Model type")
        type_label.grid(row=row + 2, column=0, sticky="w", padx=6, pady=3)
        self.model_type = ctk.CTkOptionMenu(self.frame, values=list(MODEL_TYPES))
        self.model_type.grid(row=row + 2, column=1, sticky="w", padx=6, pady=3)
        self.rows["model_type"] = [type_label, self.model_type]
        row += 1
        self.run_button = ctk.CTkButton(self.frame, text="Run", command=self.run)
        self.run_button.grid(row=row + 2, column=1, sticky="w", padx=6, pady=6)
        self.report = ctk.CTkTextbox(self.frame, height=160)
        self.report.grid(row=row + 3, column=0, columnspan=3, sticky="ew", padx=6, pady=3)
        set_readonly_text(self.report, "The report of the last tool run appears here.")
        self._show_fields()

    def _browse_buttons(self, name: str, kinds: tuple[str, ...], row: int) -> Any:
        box = ctk.CTkFrame(self.frame, fg_color="transparent")
        box.grid(row=row, column=2, sticky="w", padx=6, pady=3)
        for kind in kinds:
            button = ctk.CTkButton(box, text=BROWSE_TEXT[kind], width=70,
                                   command=lambda n=name, k=kind: self.browse_path(n, k))
            button.pack(side="left", padx=(0, 4))
            self.browse[(name, kind)] = button
        return box

    def browse_path(self, name: str, kind: str) -> None:
        """Fill a path field from a chooser (app/dialogs.py) starting in the field's folder:
        a folder, an existing .safetensors, or a new path to write (a LoRA tool writes a
        .safetensors; a merge may write a folder, so no suffix is added there)."""
        entry, title = self.entries[name], FIELDS[name][0]
        current = entry.get().strip()
        if kind == "folder":
            chosen = ask_directory(self.frame, title, current)
        elif kind == "file":
            chosen = ask_open_file(self.frame, title, current, SAFETENSORS)
        else:
            merge = TOOLS[self.tool.get()][0] == "merge"
            chosen = ask_save_file(self.frame, title, Path(start_folder(current)), SAFETENSORS,
                                   "" if merge else ".safetensors")
        if chosen:
            entry.delete(0, "end")
            entry.insert(0, chosen)

    def add_lora_file(self) -> None:
        """Append a chosen .safetensors to the LoRA files (weight 1: `:weight` can be typed
        after it), the chooser starting in the last file's folder."""
        lines = [line for line in self.loras.get("1.0", "end").splitlines() if line.strip()]
        # the chooser opens in the nearest existing folder of the last line (a `:weight`
        # after it names no folder)
        chosen = ask_open_file(self.frame, "LoRA file", lines[-1] if lines else "", SAFETENSORS)
        if chosen:
            self.loras.delete("1.0", "end")
            self.loras.insert("1.0", "\n".join([*lines, chosen]))

    def _show_fields(self) -> None:
        """Only the fields the chosen tool reads are shown, each with the hint and label that
        say what this tool takes there."""
        command, wanted = TOOLS[self.tool.get()]
        for name, (_, hint) in FIELDS.items():
            self.entries[name].configure(placeholder_text=HINTS.get((command, name), hint))
        self.loras_label.configure(text=LORAS_LABEL.get(command, LORAS_LABEL["merge"]))
        for name, widgets in self.rows.items():
            for widget in widgets:
                if name in wanted:
                    widget.grid()
                else:
                    widget.grid_remove()

    def options(self) -> dict[str, Any]:
        """The form as `frontend.lora_tool`'s arguments (a rank that is not a whole number is
        reported here, naming the field)."""
        command, wanted = TOOLS[self.tool.get()]
        options: dict[str, Any] = {"command": command,
                                   "output": self.entries["output"].get().strip()}
        options["loras"] = ([line for line in self.loras.get("1.0", "end").splitlines()
                             if line.strip()] if "loras" in wanted else [])
        for name in ("base", "config_folder", "tuned"):
            if name in wanted:
                options[name] = self.entries[name].get().strip() or None
        for name in ("rank", "conv_rank"):
            if name in wanted:
                text = self.entries[name].get().strip()
                if not text.isdigit():
                    raise ValueError(f"{FIELDS[name][0]}: {text!r} is not a whole number")
                options[name] = int(text)
        if "layout" in wanted:
            options["layout"] = self.layout.get()
        if "model_type" in wanted:
            options["model_type"] = MODEL_TYPES[self.model_type.get()]
        if "base" in wanted:  # a builtin: base is built where training builds it
            options["cache_dir"] = self.cache_dir()
        return options

    def run(self) -> None:
        if self.busy:
            return
        try:
            options = self.options()
        except ValueError as error:
            set_readonly_text(self.report, f"Not run: {error}")
            return
        self.busy = True
        set_widget_enabled(self.run_button, False)
        set_readonly_text(self.report, f"Running {options['command']}…")

        def progress(done: int, total: int, what: str) -> None:
            self.results.put(("progress", f"Running {options['command']}: layer {done} of "
                                          f"{total}\n{what}"))

        def work() -> None:
            try:
                self.results.put(("done", self.tool_fn(**options, progress=progress)))
            except frontend.LoraToolError as error:  # bad input: named in this tab's words
                self.results.put(("refused", f"Not done: {error.text(LABELS)}"))
            except ValueError as error:  # bad input the engine names by its file
                self.results.put(("refused", f"Not done: {error}"))
            except Exception as error:  # anything else is shown too, never swallowed
                self.results.put(("failed", f"Failed: {type(error).__name__}: {error}"))
        threading.Thread(target=work, name="tempera-lora-tool", daemon=True).start()
        self.frame.after(POLL_MS, self._poll)

    def _poll(self) -> None:
        """Show what the tool thread sent since the last poll: its latest progress, or how it
        ended (then the run is over)."""
        latest: tuple[str, str] | None = None
        while latest is None or latest[0] == "progress":
            try:
                latest = self.results.get_nowait()
            except queue.Empty:
                break
        if latest is not None:
            set_readonly_text(self.report, latest[1])
        if latest is None or latest[0] == "progress":
            self.frame.after(POLL_MS, self._poll)
            return
        self.busy = False
        set_widget_enabled(self.run_button, True)
        self.ok = latest[0] == "done"
