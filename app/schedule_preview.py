"""The learning-rate curve, drawn under the LR scheduler field before a run starts.

It plots `modules.frontend.schedule_curve`, the function training itself follows, over the
run's `training.max_steps`; a run counted in epochs has no step count until its dataset is
scanned, so the curve is then drawn over an assumed length and the caption says so. When no
curve describes the run (an optimizer that sets its own step size, a rejected entry in one of
the schedule's fields, a warm-up longer than the run) the caption says why and nothing is
drawn.
"""
from __future__ import annotations

import tkinter as tk
from typing import Any

import customtkinter as ctk

from app.binding import ConfigBinding
from app.readable import field_name
from modules import frontend
from modules.config.optimizers import OPTIMIZERS

WIDTH, HEIGHT, PAD = 240, 60, 3
ASSUMED_STEPS = 1000  # the length a run counted in epochs is drawn over
REDRAW_ON = ("training.lr_", "training.learning_rate", "training.max_steps",
             "training.optimizer")
LINE_COLORS = {"Light": ("#f4f4f4", "#1f6aa5", "#b0b0b0"), "Dark": ("#262626", "#5aa7e0", "#555555")}


class SchedulePreview:
    """A small canvas and a one-line caption in the field's frame, redrawn on every change of
    the schedule's settings."""

    def __init__(self, view: Any, binding: ConfigBinding) -> None:
        self.binding = binding
        scale = view.frame._get_widget_scaling()
        self.size = (round(WIDTH * scale), round(HEIGHT * scale))
        self.canvas = tk.Canvas(view.frame, width=self.size[0], height=self.size[1],
                                highlightthickness=0, borderwidth=0)
        self.canvas.grid(row=2, column=1, sticky="w", pady=(2, 0))
        self.caption = ctk.CTkLabel(view.frame, text="", anchor="w", height=15,
                                    font=ctk.CTkFont(size=11), text_color=("gray35", "gray65"))
        self.caption.grid(row=3, column=1, sticky="w", pady=(0, 4))
        # the canvas is plain Tk: its text font is scaled here, as customtkinter scales its own
        self.message_font = ctk.CTkFont(size=round(11 * scale))
        binding.subscribe(self._on_change)
        self.draw()

    def _on_change(self, path: str | None, _source: object | None) -> None:
        if path is None or path.startswith(REDRAW_ON):
            self.draw()

    def no_curve(self) -> str:
        """Why no curve is drawn now ("" when one is): a rejected entry in one of the
        schedule's fields (the config still holds the value before it), or an optimizer
        that sets its own step size (the rate and schedule do nothing)."""
        rejected = [path for path in self.binding.errors if path.startswith(REDRAW_ON)]
        if rejected:
            return f"No curve: {field_name(rejected[0]) or rejected[0]} is not a valid value"
        optimizer = OPTIMIZERS[self.binding.config.training.optimizer]
        if optimizer.own_step_size:
            return f"No curve: {optimizer.label} sets its own step size"
        return ""

    def draw(self) -> None:
        """The curve over the run's steps, the base rate as a dotted line at the top; or,
        when no curve describes the run, a short message in its place saying why."""
        config = self.binding.config
        steps = config.training.max_steps or ASSUMED_STEPS
        width, height = self.size
        background, line, guide = LINE_COLORS.get(ctk.get_appearance_mode(), LINE_COLORS["Dark"])
        self.canvas.delete("all")
        self.canvas.configure(bg=background)
        why_not = self.no_curve()
        points = [] if why_not else frontend.schedule_curve(config, steps, points=width)
        if not points:  # the reason in place of the curve: no base line, no "peak" of nothing
            self.canvas.create_text(width / 2, height / 2, width=width - 2 * PAD,
                                    font=self.message_font, fill=line, justify="center",
                                    text=why_not or "No curve: the warm-up is longer than the "
                                                    "run", tags="message")
            self.caption.configure(text="")
            return
        peak = max((lr for _, lr in points), default=0.0) or 1.0
        top, bottom = PAD + 4, height - PAD

        def xy(step: int, lr: float) -> tuple[float, float]:
            return (PAD + (width - 2 * PAD) * step / steps,
                    bottom - (bottom - top) * lr / peak)

        self.canvas.create_line(PAD, top, width - PAD, top, fill=guide, dash=(2, 3),
                                tags="base")
        coords = [c for step, lr in points for c in xy(step, lr)]
        if len(coords) >= 4:
            self.canvas.create_line(*coords, fill=line, width=2, tags="curve")
        length = (f"over {steps:,} steps" if config.training.max_steps else
                  f"over an assumed {steps:,} steps (the run counts epochs)")
        self.caption.configure(text=f"peak {peak:.2g}, {length}")
