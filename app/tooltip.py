"""A small hover tooltip: the field's help text, shown after a short delay."""
from __future__ import annotations

import tkinter
from typing import Any

DELAY_MS = 500


class Tooltip:
    def __init__(self, widget: Any, text: str, wraplength: int = 380) -> None:
        self.widget, self.text, self.wraplength = widget, text, wraplength
        self.window: tkinter.Toplevel | None = None
        self._pending: str | None = None
        widget.bind("<Enter>", self._schedule, add="+")
        widget.bind("<Leave>", self.hide, add="+")
        widget.bind("<ButtonPress>", self.hide, add="+")

    def _schedule(self, _event: Any = None) -> None:
        self._cancel()
        self._pending = self.widget.after(DELAY_MS, self.show)

    def _cancel(self) -> None:
        if self._pending is not None:
            self.widget.after_cancel(self._pending)
            self._pending = None

    def show(self) -> None:
        self._pending = None
        if self.window is not None or not self.text:
            return
        x = self.widget.winfo_rootx() + 16
        y = self.widget.winfo_rooty() + self.widget.winfo_height() + 4
        self.window = tkinter.Toplevel(self.widget)
        self.window.wm_overrideredirect(True)
        self.window.wm_geometry(f"+{x}+{y}")
        tkinter.Label(self.window, text=self.text, justify="left", wraplength=self.wraplength,
                      background="#ffffe0", foreground="#202020", relief="solid",
                      borderwidth=1, padx=6, pady=4).pack()

    def hide(self, _event: Any = None) -> None:
        self._cancel()
        if self.window is not None:
            self.window.destroy()
            self.window = None
