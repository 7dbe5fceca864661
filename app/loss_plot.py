"""A live loss curve on a plain tk Canvas: raw loss (thin), smoothed loss (thick) and, when the
run validates, the validation loss (points joined, the best one ringed), with a legend."""
from __future__ import annotations

import tkinter
from typing import Any

PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 56, 12, 14, 24
LOSS_COLOR, SMOOTHED_COLOR, VALIDATION_COLOR = "#6b8fb3", "#ffb74d", "#81c784"


class LossPlot:
    def __init__(self, parent: Any, width: int = 520, height: int = 260) -> None:
        self.canvas = tkinter.Canvas(parent, width=width, height=height, background="#1e1e1e",
                                     highlightthickness=0)
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.smoothed: list[float] = []
        self.validation: list[tuple[int, float]] = []  # (step, loss); not-finite ones left out
        self.best_step: int | None = None
        self.canvas.bind("<Configure>", lambda _e: self.redraw())

    def clear(self) -> None:
        self.steps, self.losses, self.smoothed = [], [], []
        self.validation, self.best_step = [], None
        self.redraw()

    def add(self, step: int, loss: float, smoothed: float) -> None:
        self.steps.append(step)
        self.losses.append(loss)
        self.smoothed.append(smoothed)

    def add_validation(self, step: int, loss: float | None, best_step: int | None) -> None:
        """One validation pass; `best_step` is the run's best so far (ringed)."""
        if loss is not None:
            self.validation.append((step, loss))
        self.best_step = best_step

    def series(self) -> list[tuple[str, str, int, list[tuple[int, float]]]]:
        """(name, colour, line width, points) of every series that has points."""
        rows = [("loss", LOSS_COLOR, 1, list(zip(self.steps, self.losses))),
                ("smoothed", SMOOTHED_COLOR, 2, list(zip(self.steps, self.smoothed))),
                ("validation", VALIDATION_COLOR, 2, list(self.validation))]
        return [row for row in rows if row[3]]

    def redraw(self) -> None:
        c = self.canvas
        c.delete("all")
        w, h = max(c.winfo_width(), 100), max(c.winfo_height(), 80)
        x0, x1, y0, y1 = PAD_LEFT, w - PAD_RIGHT, PAD_TOP, h - PAD_BOTTOM
        c.create_rectangle(x0, y0, x1, y1, outline="#555555")
        series = self.series()
        if not series:
            c.create_text((x0 + x1) / 2, (y0 + y1) / 2, text="loss appears here during training",
                          fill="#888888")
            return
        points = [p for _, _, _, pts in series for p in pts]
        lo, hi = min(v for _, v in points), max(v for _, v in points)
        if hi - lo < 1e-12:
            lo, hi = lo - 0.5, hi + 0.5
        first = min(s for s, _ in points)
        last = max(max(s for s, _ in points), first + 1)

        def point(step: int, value: float) -> tuple[float, float]:
            x = x0 + (step - first) / (last - first) * (x1 - x0)
            y = y1 - (value - lo) / (hi - lo) * (y1 - y0)
            return x, y

        for name, color, width, pts in series:
            coords = [v for s, l in pts for v in point(s, l)]
            tags = ("curve", name)
            if len(coords) >= 4:
                c.create_line(*coords, fill=color, width=width, tags=tags)
            if name == "validation" or len(coords) < 4:  # validation passes are few: dots
                for x, y in zip(coords[::2], coords[1::2]):
                    c.create_oval(x - 2, y - 2, x + 2, y + 2, fill=color, outline=color,
                                  tags=tags)
        self._ring_best(point)
        for value, y in ((hi, y0), (lo, y1)):
            c.create_text(x0 - 4, y, text=f"{value:.4g}", anchor="e", fill="#bbbbbb")
        c.create_text(x0, y1 + 4, text=str(first), anchor="nw", fill="#bbbbbb")
        newest = max(s for s, _ in points)
        c.create_text(x1, y1 + 4, text=f"step {newest}", anchor="ne", fill="#bbbbbb")
        self._legend(series, x1 - 4, y0 + 4)

    def _ring_best(self, point) -> None:
        best = [(s, v) for s, v in self.validation if s == self.best_step]
        if best:
            x, y = point(*best[-1])
            self.canvas.create_oval(x - 5, y - 5, x + 5, y + 5, outline=VALIDATION_COLOR,
                                    width=2, tags=("best",))

    def _legend(self, series, right: float, top: float) -> None:
        """Each series' name in its colour, right-aligned along the top edge."""
        x = right
        for name, color, _, _ in reversed(series):
            label = (f"{name} (best: step {self.best_step})"
                     if name == "validation" and self.best_step is not None else name)
            item = self.canvas.create_text(x, top, text=label, anchor="ne", fill=color,
                                           tags=("legend",))
            left = self.canvas.bbox(item)[0] if self.canvas.bbox(item) else x - 60
            x = left - 10
