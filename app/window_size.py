"""The window's size on screen: the saved geometry fitted to the screen, the UI scale menu, the
minimum size, and the tabs' columns stacked when they do not fit the window's width.

customtkinter scales widgets and window sizes by two factors of its own; `apply_scaling` sets
both, and `forget_scaling_registration` drops a closed window from its class-level registry.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import customtkinter as ctk

from app.form import FieldRegistry
from app.settings import SCALES, UISettings

FIT_MS = 120  # the columns are fitted this long after the window's size settles
COMPACT_BELOW = 700  # a window shorter than this (unscaled) gets the compact run bar
SCROLL_STEP = 60  # one notch of the mouse wheel moves a page this far (unscaled: 3 lines)


class WindowSizing:
    """Owns the UI scale menu (packed on the right of `bar`) and the column fitting."""

    def __init__(self, window: Any, bar: Any, tabview: Any, registry: FieldRegistry,
                 settings: UISettings, save_settings: Callable[[], None]) -> None:
        self.window, self.tabview, self.registry = window, tabview, registry
        self.settings, self.save_settings = settings, save_settings
        self._fit_id: str | None = None
        self.set_compact: Callable[[bool], None] = lambda compact: None  # the run bar's
        self.pages: list[Any] = []  # the tabs' scrollable pages (their wheel step)
        # Packed first, so a narrow window clips the preset controls, never the way back
        # from a too-large scale.
        self.scale_menu = ctk.CTkOptionMenu(bar, values=[f"{int(s * 100)}%" for s in SCALES],
                                            width=90, command=self.scale_chosen)
        self.scale_menu.set(f"{int(settings.scaling * 100)}%")
        self.scale_menu.pack(side="right", padx=(4, 10))
        ctk.CTkLabel(bar, text="UI scale").pack(side="right")
        window.bind("<Configure>", self._resized, add="+")

    def scale_chosen(self, text: str) -> None:
        """Scale the widgets, not the window: it keeps its size on screen (customtkinter would
        grow it with the scale, past the screen's edge), and the minimum size stays on screen."""
        window = self.window
        width, height = window.winfo_width(), window.winfo_height()
        scale = int(text.rstrip("%")) / 100
        # customtkinter redraws every widget, in Python, for seconds on a loaded machine: under
        # a curtain, so that the buttons without their labels in between are never seen
        with window.curtain.covering(f"Changing the UI scale to {text}…", scale):
            self.settings.scaling = scale
            apply_scaling(scale)
            fit_minsize(window, scale)
            screen_w, screen_h = window.winfo_screenwidth(), window.winfo_screenheight()
            window.geometry(f"{int(min(width, screen_w) / scale)}x"
                            f"{int(min(height, screen_h) / scale)}")
            self.fit_columns()
        self.save_settings()

    def _resized(self, event: Any) -> None:
        if event.widget is self.window and not self.window.closed:
            if self._fit_id is not None:
                self.window.after_cancel(self._fit_id)
            self._fit_id = self.window.after(FIT_MS, self.fit_columns)

    def fit_columns(self) -> None:
        """Stack each tab's columns when they do not fit its width (ColumnLayout). Driven by
        the window's own size, which the layout does not change, so it cannot loop."""
        self._fit_id = None
        self.window.update_idletasks()
        scale = self.tabview._get_widget_scaling()
        self.set_compact(self.window.winfo_height() / scale < COMPACT_BELOW)
        for page in self.pages:  # customtkinter scrolls 30 px a notch at any scale
            page._parent_canvas.configure(yscrollincrement=round(SCROLL_STEP * scale))
        width = self.tabview.winfo_width() - 40 * scale
        if width > 1:
            for layout in self.registry.layouts:
                layout.arrange(stacked=layout.needed_width() > width)

    def close(self) -> None:
        """Cancel the pending column fit and leave customtkinter's scaling registry."""
        if self._fit_id is not None:
            self.window.after_cancel(self._fit_id)
        forget_scaling_registration(self.window)


def place_window(window: Any, settings: UISettings) -> None:
    """The saved geometry, fitted to this screen, and the minimum size."""
    window.geometry(fit_geometry(settings.geometry, (window.winfo_screenwidth(),
                                 window.winfo_screenheight()), settings.scaling))
    fit_minsize(window, settings.scaling)


def fit_minsize(window: Any, scale: float) -> None:
    """960x640 on screen at most (customtkinter scales the minimum with the UI scale),
    and never more than the screen holds."""
    screen_w, screen_h = window.winfo_screenwidth(), window.winfo_screenheight()
    window.minsize(int(min(960, screen_w * 0.9) / scale), int(min(640, screen_h * 0.9) / scale))


def fit_geometry(geometry: str, screen: tuple[int, int], scale: float) -> str:
    """A saved window geometry ("WxH" or "WxH+X+Y", customtkinter's unscaled units) shrunk and
    moved so that the window fits `screen` (a smaller screen, a larger UI scale)."""
    match = re.fullmatch(r"(\d+)x(\d+)(?:\+(-?\d+)\+(-?\d+))?", geometry.strip())
    if match is None:
        return geometry
    screen_w, screen_h = screen
    width = min(int(match[1]), int(screen_w * 0.96 / scale))
    height = min(int(match[2]), int(screen_h * 0.92 / scale))
    if match[3] is None:
        return f"{width}x{height}"
    x = min(max(int(match[3]), 0), max(screen_w - int(width * scale), 0))
    y = min(max(int(match[4]), 0), max(screen_h - int(height * scale), 0))
    return f"{width}x{height}+{x}+{y}"


def apply_scaling(scale: float) -> None:
    """HiDPI: scale widgets and window sizes together (customtkinter's two factors)."""
    from customtkinter import ScalingTracker
    if ScalingTracker.widget_scaling != scale or ScalingTracker.window_scaling != scale:
        ctk.set_widget_scaling(scale)
        ctk.set_window_scaling(scale)


def forget_scaling_registration(window: Any) -> None:
    """Drop a closing window from customtkinter's scaling registry.

    customtkinter keeps every window it has seen in class-level dicts and calls their widgets
    on each scale change; a destroyed window's widgets would then raise TclError when a later
    window (the next session in one process, e.g. tests) changes the scale.
    """
    from customtkinter import ScalingTracker
    ScalingTracker.window_widgets_dict.pop(window, None)
    ScalingTracker.window_dpi_scaling_dict.pop(window, None)
