"""A curtain over the window's content while it is built or rescaled: the first paint and a UI
scale change show a complete window (a line saying what happens), never a half-drawn form.

Why: customtkinter draws each widget in Python when its size changes. A window built while
withdrawn is 1x1 px until it is first mapped (Tk applies the geometry only then), so at the
first map every widget was laid out and drawn again (a second, 18 s after launch on a loaded
machine), and the screen showed an empty grey frame, then buttons without their labels. A UI
scale change redraws every widget the same way. Under the curtain the window is mapped at its
size from the start, the form is laid out and drawn behind it, and once it is lifted Tk only
repaints what is already drawn (its own C code, no Python).

The curtain is plain tkinter (a frame and a label), not customtkinter: it is not rescaled by
the scale change it covers, and it is drawn without Python callbacks.
"""
from __future__ import annotations

import contextlib
import tkinter
from collections.abc import Iterator
from typing import Any

import _tkinter

from customtkinter import ThemeManager

FONT_SIZE = 15  # px at 100 %


class Curtain:
    """A cover over all of `window`'s children while it is shown (`show`, `lift`)."""

    def __init__(self, window: Any) -> None:
        self.window = window
        background = window._apply_appearance_mode(ThemeManager.theme["CTk"]["fg_color"])
        foreground = window._apply_appearance_mode(ThemeManager.theme["CTkLabel"]["text_color"])
        self.frame = tkinter.Frame(window, bg=background, borderwidth=0, highlightthickness=0)
        self.label = tkinter.Label(self.frame, bg=background, fg=foreground, justify="center")
        self.label.place(relx=0.5, rely=0.4, anchor="center")
        self.text = ""

    @property
    def shown(self) -> bool:
        return bool(self.frame.winfo_manager())

    def show(self, text: str, scale: float = 1.0) -> None:
        """Cover the window and paint `text` on it now (before the caller's long work, which
        holds the Tk thread: nothing else is painted until it returns)."""
        self.frame.place(x=0, y=0, relwidth=1, relheight=1)
        self.lift()
        self._set(text, scale)  # its font is looked up before the window is on screen, blank
        self.window.update_idletasks()  # on screen (the window too, at launch), above the content
        # A label paints itself when configured while mapped; its Expose event would wait for
        # the event loop, which the caller's work holds.
        self.say(text, scale)

    @contextlib.contextmanager
    def covering(self, text: str, scale: float = 1.0) -> Iterator[None]:
        """The window covered while the block runs, uncovered and painted after it (also when
        it raises: a curtain left up would hide a working window)."""
        self.show(text, scale)
        try:
            yield
        finally:
            self.hide()

    def say(self, text: str, scale: float = 1.0) -> None:
        """Change the curtain's line (what is being done now) and paint it."""
        self._set(text, scale)
        self.window.update_idletasks()

    def _set(self, text: str, scale: float) -> None:
        self.text = text
        family = ThemeManager.theme["CTkFont"]["family"]
        self.label.configure(text=text, font=(family, -round(FONT_SIZE * scale)))

    def lift(self) -> None:
        """Above every child of the window: a child made after the curtain is stacked above it
        until this is called."""
        self.frame.lift()

    def hide(self) -> None:
        """Uncover the content, once laid out behind the curtain, and paint it before returning
        (what is uncovered is painted by Tk alone, from the Expose events the X server sends)."""
        window = self.window
        self.lift()
        window.update_idletasks()
        self.frame.place_forget()
        window.winfo_pointerxy()  # a round trip: the server's Expose events have arrived
        # Window events only: the Expose events (and input that reached the curtain), not the
        # timers and idle work of the event loop, which `update()` would run here.
        while window.tk.dooneevent(_tkinter.WINDOW_EVENTS | _tkinter.DONT_WAIT):
            pass
        window.update_idletasks()  # the redraws those events asked for
