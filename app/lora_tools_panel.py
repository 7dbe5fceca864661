"""The LoRA tools tab: merge, merge several, extract, resize, convert (docs/lora_tools.md).

A form over `frontend.lora_tool`: the tool runs in a thread (it reads whole models), its report
or its error comes back through a queue the Tk thread polls with `after()`.
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
    "Merge LoRAs into a model": ("merge", ("base", "loras", "output")),
    "Merge LoRAs into one": ("merge-loras", ("base", "model_type", "loras", "layout", "output")),
    "Extract a LoRA (two models)": ("extract", ("base", "tuned", "rank", "conv_rank",
                                                "layout", "output")),
    "Resize a LoRA": ("resize", ("base", "model_type", "loras", "rank", "layout", "output")),
    "Convert a LoRA's layout": ("convert", ("base", "model_type", "loras", "layout", "output")),
}
FIELDS = {  # field -> (label, hint)
    "base": ("Base model", "a diffusers folder, an SD / SDXL .safetensors or Z-Image's "
                           "ComfyUI diffusion model"),
    "tuned": ("Fine-tuned model", "extract: the model the LoRA is taken from"),
    "rank": ("Rank", "the LoRA's rank (resize: the new one)"),
    "conv_rank": ("Conv rank", "extract: convolutions' rank (0: left out)"),
    "output": ("Output", "a new folder or .safetensors (never overwritten)"),
}
SAFETENSORS: tuple[str, tuple[str, ...]] = ("Safetensors", ("*.safetensors",))
# the Browse buttons beside each path field: a folder ("folder"), an existing .safetensors
# ("file") or a new path to write ("save")
BROWSE = {"base": ("folder", "file"), "tuned": ("folder", "file"), "output": ("save",)}
BROWSE_TEXT = {"folder": "Folder…", "file": "File…", "save": "Save as…"}
LAYOUTS = ("kohya", "diffusers")
# without a base model, the family's shipped architecture names the layers
MODEL_TYPES = {"from the base model": None, "SD 1.x": "sd15", "SD 2.x": "sd2", "SDXL": "sdxl",
               "Z-Image": "zimage"}
POLL_MS = 100


class LoraToolsPanel:
    """The tab's widgets and the one tool run at a time."""

    def __init__(self, parent: Any, tool_fn: Callable[..., str] = frontend.lora_tool) -> None:
        self.tool_fn = tool_fn
        self.results: "queue.Queue[tuple[bool, str]]" = queue.Queue()
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
        loras_label = ctk.CTkLabel(self.frame, text="LoRA files\n(one per line,\nfile:weight)")
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
        """Only the fields the chosen tool reads are shown."""
        wanted = TOOLS[self.tool.get()][1]
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
        for name in ("base", "tuned"):
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

        def work() -> None:
            try:
                self.results.put((True, self.tool_fn(**options)))
            except ValueError as error:  # bad input: the message names the file or field
                self.results.put((False, f"Not done: {error}"))
            except Exception as error:  # anything else is shown too, never swallowed
                self.results.put((False, f"Failed: {type(error).__name__}: {error}"))
        threading.Thread(target=work, name="tempera-lora-tool", daemon=True).start()
        self.frame.after(POLL_MS, self._poll)

    def _poll(self) -> None:
        try:
            ok, text = self.results.get_nowait()
        except queue.Empty:
            self.frame.after(POLL_MS, self._poll)
            return
        self.busy = False
        set_widget_enabled(self.run_button, True)
        set_readonly_text(self.report, text)
        self.ok = ok
