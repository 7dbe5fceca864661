"""The problems panel below the tabs: what keeps a start, a save or a check from going ahead.

Each problem is a button named by the labels on screen; a click jumps to its field (the
window's `jump_to`), and the fields it names show it in red too. With a `source` (what found
the problems) the list follows the edits: fixed problems leave it, and it closes when none is
left.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import customtkinter as ctk

from app.form import FieldRegistry
from app.readable import readable
from app.widgets import grid_hide
from modules.config import Problem

RECHECK_MS = 400  # a listed problem is checked again this long after the last edit
MAX_ROWS, ROW_HEIGHT = 4, 30  # the list opens with a row per problem, up to MAX_ROWS


class ProblemsPanel:
    def __init__(self, window: Any, registry: FieldRegistry, jump_to: Callable[[str], bool],
                 all_fixed: Callable[[], None]) -> None:
        self.window, self.registry = window, registry
        self.jump_to, self.all_fixed = jump_to, all_fixed
        self.buttons: list[Any] = []
        self.problems: list[Problem] = []
        self._source: Callable[[], list[Problem]] | None = None
        self._marks: list[Any] = []  # views showing a listed problem
        self._recheck_id: str | None = None
        self._heading: str | None = None
        self._keys = False
        self._rows = MAX_ROWS  # the rows the open list shows (set when it opens)
        self.frame = ctk.CTkFrame(window, border_width=2, border_color=("#c62828", "#ef5350"))
        head = ctk.CTkFrame(self.frame, fg_color="transparent")
        head.pack(fill="x", padx=8, pady=(6, 0))
        self.title = ctk.CTkLabel(head, text="", anchor="w", font=ctk.CTkFont(weight="bold"))
        self.title.pack(side="left")
        ctk.CTkButton(head, text="✕", width=28, command=self.hide).pack(side="right")
        self.list = ctk.CTkScrollableFrame(self.frame, height=110, fg_color="transparent")
        self.list.pack(fill="x", padx=4, pady=(0, 6))

    @property
    def is_open(self) -> bool:
        return bool(self.frame.winfo_manager())

    def show(self, problems: list[Problem], title: str | None = None,
             source: Callable[[], list[Problem]] | None = None, keys: bool = False) -> None:
        """List every problem by the labels on screen (`keys`: with the file's key first, for a
        preset file's problems); `source` makes the list follow the edits."""
        for button in self.buttons:
            button.destroy()
        self._unmark()
        self.buttons = []
        self.problems, self._source = list(problems), source
        self._heading, self._keys = title, keys  # kept for the re-check
        self.title.configure(text=title or f"Cannot start: {len(problems)} problem(s). Click "
                                           "one to go to its field.")
        for problem in problems:
            button = ctk.CTkButton(self.list, text=f"• {self.describe(problem, keys)}",
                                   anchor="w", fg_color="transparent",
                                   text_color=("#b71c1c", "#ef9a9a"),
                                   hover_color=("gray85", "gray25"),
                                   command=lambda p=problem: self.jump_to(p.path))
            button.pack(fill="x")
            self.buttons.append(button)
            view = self.registry.find(problem.path)
            if view is not None and not view.error:  # named as the list names it
                view.show_error(problem.detail() if keys else readable(problem.detail()))
                self._marks.append(view)
        if not self.is_open:
            # Sized when it opens and kept while it is open (a longer list scrolls): a panel
            # that shrank as problems were fixed moved the fields under the pointer.
            self._rows = min(max(len(problems), 1), MAX_ROWS)
            height = self._rows * ROW_HEIGHT
            self.list.configure(height=height)
            self.list._scrollbar.configure(height=height)  # its own minimum is 200 px
        # a scrollbar only when the list is longer than the rows it shows
        if len(problems) > self._rows:
            self.list._scrollbar.grid()
        else:
            self.list._scrollbar.grid_remove()
        self.frame.grid(row=2, column=0, sticky="ew", padx=8, pady=(4, 0))

    def describe(self, problem: Problem, keys: bool = False) -> str:
        """A problem as the window names it: "Training › Batch size: expected …, got …"
        (`keys`: "training.batch_size (Training › Batch size): …")."""
        where = self.registry.where(problem.path)
        if keys and where != problem.path:
            where = f"{problem.path} ({where})"
        return f"{where}: {problem.detail() if keys else readable(problem.detail())}"

    def schedule_recheck(self) -> None:
        """After an edit: check the listed problems again once the typing pauses."""
        if self._source is None or not self.is_open:
            return
        if self._recheck_id is not None:
            self.window.after_cancel(self._recheck_id)
        self._recheck_id = self.window.after(RECHECK_MS, self._recheck)

    def _recheck(self) -> None:
        self._recheck_id = None
        if self._source is None or self.window.closed:
            return
        problems = self._source()
        if problems:
            self.show(problems, self._heading, self._source, self._keys)
        else:
            self.hide()
            self.all_fixed()

    def hide(self) -> None:
        grid_hide(self.frame)
        self._source = None
        self._unmark()

    def _unmark(self) -> None:
        """Each field the list marked back to its own error; a field whose widgets are gone
        (a dataset row removed, or rebuilt by a preset load) has nothing left to unmark."""
        for view in self._marks:
            if view.frame.winfo_exists():
                view.show_own_error()
        self._marks = []
