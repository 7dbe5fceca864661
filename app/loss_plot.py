"""A live loss curve on a plain tk Canvas: raw loss (thin) and smoothed loss (thick)."""
from __future__ import annotations

import tkinter
from typing import Any

PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 56, 12, 14, 24


class LossPlot:
    def __init__(self, parent: Any, width: int = 520, height: int = 260) -> None:
        self.canvas = tkinter.Canvas(parent, width=width, height=height, background="#1e1e1e",
                                     highlightthickness=0)
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.smoothed: list[float] = []
        self.canvas.bind("<Configure>", lambda _e: self.redraw())

    def clear(self) -> None:
        self.steps, self.losses, self.smoothed = [], [], []
        self.redraw()

    def add(self, step: int, loss: float, smoothed: float) -> None:
        self.steps.append(step)
        self.losses.append(loss)
        self.smoothed.append(smoothed)

    def redraw(self) -> None:
        c = self.canvas
        c.delete("all")
        w, h = max(c.winfo_width(), 100), max(c.winfo_height(), 80)
        x0, x1, y0, y1 = PAD_LEFT, w - PAD_RIGHT, PAD_TOP, h - PAD_BOTTOM
        c.create_rectangle(x0, y0, x1, y1, outline="#555555")
        if not self.steps:
            c.create_text((x0 + x1) / 2, (y0 + y1) / 2, text="loss appears here during training",
                          fill="#888888")
            return
        lo, hi = min(self.losses + self.smoothed), max(self.losses + self.smoothed)
        if hi - lo < 1e-12:
            lo, hi = lo - 0.5, hi + 0.5
        first, last = self.steps[0], max(self.steps[-1], self.steps[0] + 1)

        def point(step: int, value: float) -> tuple[float, float]:
            x = x0 + (step - first) / (last - first) * (x1 - x0)
            y = y1 - (value - lo) / (hi - lo) * (y1 - y0)
            return x, y

        for values, color, width in ((self.losses, "#6b8fb3", 1), (self.smoothed, "#ffb74d", 2)):
            coords = [v for s, l in zip(self.steps, values) for v in point(s, l)]
            if len(coords) >= 4:
                c.create_line(*coords, fill=color, width=width, tags=("curve",))
            else:
                x, y = coords
                c.create_oval(x - 2, y - 2, x + 2, y + 2, fill=color, outline=color,
                              tags=("curve",))
        for value, y in ((hi, y0), (lo, y1)):
            c.create_text(x0 - 4, y, text=f"{value:.4g}", anchor="e", fill="#bbbbbb")
        c.create_text(x0, y1 + 4, text=str(first), anchor="nw", fill="#bbbbbb")
        c.create_text(x1, y1 + 4, text=f"step {self.steps[-1]}", anchor="ne", fill="#bbbbbb")
        c.create_text(x1 - 4, y0 + 4, text="loss (smoothed: orange)", anchor="ne",
                      fill="#bbbbbb")
