"""Start in an output folder that holds a run: the question asked first.

With *Overwrite previous run* on, a fresh start removes the earlier run's backups, samples and
logs and its first save replaces final/ (`modules/train/outputs/previous_run.py` says what,
read from the disk). **Start** asks first, naming what would go, and offers a numbered folder
beside it instead. The window takes the asking function as an argument (`AskReplace`), so
tests answer it without a dialog.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import customtkinter as ctk

REPLACE, NEW_FOLDER = "replace", "new_folder"
# (what would be removed, the folder offered instead) -> REPLACE, NEW_FOLDER or None (cancel)
AskReplace = Callable[[str, Path], "str | None"]
TITLE = "Replace the run in the output folder?"


class ReplaceDialog(ctk.CTkToplevel):
    """A modal window: the paragraph, then Replace and start / Start in <new> / Cancel."""

    def __init__(self, parent: Any, message: str, new_folder: Path) -> None:
        super().__init__(parent)
        self.title(TITLE)
        self.choice: str | None = None
        self.transient(parent)
        self.message = ctk.CTkLabel(self, text=message, wraplength=520, justify="left",
                                    anchor="w")
        self.message.pack(fill="x", padx=16, pady=(16, 12))
        row = ctk.CTkFrame(self, fg_color="transparent")
        row.pack(fill="x", padx=16, pady=(0, 16))
        self.buttons = {
            REPLACE: ctk.CTkButton(row, text="Replace and start",
                                   fg_color=("#c62828", "#b71c1c"),
                                   hover_color=("#8e0000", "#7f0000"),
                                   command=lambda: self._answer(REPLACE)),
            NEW_FOLDER: ctk.CTkButton(row, text=f"Start in {new_folder.name}/",
                                      command=lambda: self._answer(NEW_FOLDER)),
            "cancel": ctk.CTkButton(row, text="Cancel", width=90,
                                    command=lambda: self._answer(None))}
        for button in self.buttons.values():
            button.pack(side="left", padx=(0, 8))
        self.protocol("WM_DELETE_WINDOW", lambda: self._answer(None))
        self.bind("<Escape>", lambda _e: self._answer(None))

    def _answer(self, choice: str | None) -> None:
        self.choice = choice
        self.grab_release()
        self.destroy()

    def ask(self) -> str | None:
        """Wait (the window's events keep running) until a button or the close answers."""
        self.wait_visibility()
        self.grab_set()
        self.buttons["cancel"].focus_set()
        self.wait_window()
        return self.choice


def ask_replace(parent: Any, message: str, new_folder: Path) -> str | None:
    """The dialog's answer: REPLACE, NEW_FOLDER, or None (cancelled)."""
    return ReplaceDialog(parent, message, new_folder).ask()
