"""The preset bar above the tabs: the presets menu, Load, Save and Save as…, and what is loaded.

It owns the loaded preset (`current`) and whether the form was edited since it was loaded or
saved (`dirty`, shown as "*" in the window's title). Problems it finds (a preset that does not
load, fields that cannot be saved) go to the window's problems panel through `show_problems`.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import customtkinter as ctk

from app.binding import ConfigBinding
from app.dialogs import ask_save_file
from app.presets import BuiltinPresetError, PresetEntry, is_builtin, list_presets, save_preset
from app.settings import UISettings
from modules.config import ConfigError, load_config

NO_PRESET = "(no presets found)"


class PresetsBar:
    def __init__(self, bar: Any, binding: ConfigBinding, settings: UISettings, builtin_dir: Path,
                 *, confirm: Callable[[str, str], bool],
                 ask_save_path: Callable[[Path], str | None] | None,
                 show_problems: Callable[..., None], hide_problems: Callable[[], None],
                 set_status: Callable[..., None], log: Callable[[str], None],
                 set_title: Callable[[str], None], loaded: Callable[[], None],
                 action: Callable[[Callable[[], Any]], Callable[[], Any]]) -> None:
        self.binding, self.settings, self.builtin_dir = binding, settings, builtin_dir
        self.confirm = confirm
        self.ask_save_path = ask_save_path or (lambda folder: self._ask_save_path(bar, folder))
        self.show_problems, self.hide_problems = show_problems, hide_problems
        self.set_status, self.log, self.set_title, self.loaded = set_status, log, set_title, loaded
        self.current: Path | None = None
        self.dirty = False  # edits since the preset was loaded or saved
        self.presets: list[PresetEntry] = []
        ctk.CTkLabel(bar, text="Preset").pack(side="left", padx=(10, 6), pady=6)
        self.menu = ctk.CTkOptionMenu(bar, values=[NO_PRESET], width=300, dynamic_resizing=False)
        self.menu.pack(side="left")
        self.buttons: dict[str, Any] = {}
        for text, command in (("Load", self.load_selected), ("Save", self.save),
                              ("Save as…", self.save_as)):
            self.buttons[text] = ctk.CTkButton(bar, text=text, width=80, command=action(command))
            self.buttons[text].pack(side="left", padx=3)
        self.refresh()

    def refresh(self) -> None:
        """List the presets again; the menu shows the loaded one."""
        self.presets = list_presets(self.builtin_dir, self.settings.user_presets_path)
        labels = [p.label for p in self.presets] or [NO_PRESET]
        self.menu.configure(values=labels)
        current = next((p.label for p in self.presets if self.current
                        and p.path.resolve() == self.current.resolve()), None)
        if current is None and self.current is not None:
            current = self.current.name  # a file from elsewhere (--config): its name
        self.menu.set(current or labels[0])

    def load_initial(self, initial: Path | None) -> None:
        """The preset named on the command line, else the last one used, else the demo."""
        candidates = [initial, Path(self.settings.last_preset) if self.settings.last_preset
                      else None, self.builtin_dir / "demo.json"]
        for path in candidates:
            if path is not None and Path(path).is_file():
                self.load(Path(path))
                return
        self.set_status("Ready: default settings (no preset loaded).")

    def load_selected(self) -> bool:
        entry = next((p for p in self.presets if p.label == self.menu.get()), None)
        if entry is None:
            return False
        if self.dirty and not self.confirm(
                "Discard your changes?", "The settings were changed since the preset was loaded "
                f"or saved. Load {entry.label} and lose those changes?"):
            self.refresh()  # the menu shows what is still loaded, not the declined one
            return False
        return self.load(entry.path)

    def display_name(self) -> str:
        """The loaded preset as the menu names it ("sdxl / lora": lora.json alone does not
        say which family), or its file name when it is not listed (--config)."""
        if self.current is None:
            return "unsaved settings"
        resolved = self.current.resolve()
        listed = next((p.label for p in self.presets if p.path.resolve() == resolved), None)
        return listed or self.current.name

    def set_dirty(self, dirty: bool) -> None:
        """Mark unsaved edits in the title ("*"), as editors do."""
        self.dirty = dirty
        self.set_title(f"Tempera — {self.display_name()}{' *' if dirty else ''}")

    def load(self, path: Path) -> bool:
        """Load a preset file into the window; its problems are listed, nothing crashes."""
        try:
            config = load_config(path)
        except ConfigError as exc:
            self.show_problems(exc.problems, f"{path} could not be loaded", keys=True)
            self.set_status(f"Could not load {path}: {len(exc.problems)} problem(s).",
                            error=True)
            return False
        self.binding.replace(config)
        self.current = Path(path)
        self.settings.last_preset = str(Path(path).resolve())
        self.refresh()
        self.set_dirty(False)
        self.loaded()
        self.hide_problems()
        self.set_status(f"Loaded {path}.")
        return True

    def save(self) -> Path | None:
        """Save onto the current preset; a built-in (or no) preset goes through Save as…."""
        if self.current is None or is_builtin(self.current, self.builtin_dir):
            return self.save_as()
        return self._write(self.current)

    def save_as(self, target: Path | None = None) -> Path | None:
        if self._refused():  # before the file chooser: no name is asked for in vain
            return None
        if target is None:
            chosen = self.ask_save_path(self.settings.user_presets_path)
            if not chosen:
                return None
            target = Path(chosen)
        allow_new_builtin = False
        if is_builtin(target, self.builtin_dir) and not target.with_suffix(".json").exists():
            allow_new_builtin = self.confirm(
                "Add a built-in preset?", f"{target} is inside the built-in presets folder. "
                "Add it there (for Tempera's developers)?")
            if not allow_new_builtin:
                return None
        return self._write(target, allow_new_builtin)

    def _refused(self) -> bool:
        """What no preset can hold (unparsable text, a value the loader refuses such as a W&B
        API key) is listed and marked at its field, and nothing is written."""
        problems = self.binding.field_problems()
        if problems:
            self.show_problems(problems, "Fix these fields before saving",
                               source=self.binding.field_problems)
            self.set_status(f"Not saved: {len(problems)} problem(s), listed below the tabs.",
                            error=True)
        return bool(problems)

    def _write(self, target: Path, allow_new_builtin: bool = False) -> Path | None:
        if self._refused():
            return None
        try:
            written = save_preset(self.binding.config, target, self.builtin_dir, allow_new_builtin)
        except (BuiltinPresetError, OSError) as exc:
            self.set_status(f"Not saved: {exc}", error=True)
            self.log(f"not saved: {exc}")
            return None
        self.current = written
        self.settings.last_preset = str(written.resolve())
        self.refresh()
        self.set_dirty(False)
        self.set_status(f"Saved {written}.")
        self.log(f"saved preset {written}")
        return written

    @staticmethod
    def _ask_save_path(parent: Any, initial_dir: Path) -> str | None:
        initial_dir.mkdir(parents=True, exist_ok=True)
        return ask_save_file(parent.winfo_toplevel(), "Save preset as", initial_dir,
                             ("Tempera preset", ("*.json",)), ".json")
