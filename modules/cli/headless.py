"""Trainer callbacks for a terminal: a tqdm progress bar plus status, compile and error lines."""
from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm

from modules.util.duration import format_duration
from modules.events import CompileEvent, Progress, ValidationScore


class TerminalCallbacks:
    """Shows training in a terminal; every line also goes to the bar-safe `tqdm.write`."""

    def __init__(self, quiet: bool = False, bar: bool = True) -> None:
        self.quiet = quiet
        self.show_bar = bar  # off for logs (cloud runs): ProgressReporter writes clean lines
        self.bar: tqdm | None = None

    def _line(self, text: str) -> None:
        if not self.quiet:
            tqdm.write(text, file=sys.stderr)

    def on_status(self, text: str) -> None:
        self._line(f"[tempera] {text}")

    def on_progress(self, progress: Progress) -> None:
        if self.quiet or not self.show_bar:
            return
        if self.bar is None:
            # tqdm's own "remaining" counts steps only; the engine's ETA adds the sampling
            # passes still to come, so the bar shows that one instead.
            self.bar = tqdm(total=progress.max_steps, unit="step", dynamic_ncols=True,
                            file=sys.stderr, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} "
                                                        "[{elapsed}, {rate_fmt}{postfix}]")
        self.bar.set_postfix(loss=f"{progress.smoothed_loss:.4f}", lr=f"{progress.lr:.2e}",
                             epoch=f"{progress.epoch}/{progress.max_epochs}",
                             eta=format_duration(progress.eta_seconds))
        self.bar.update(progress.step - self.bar.n)

    def on_sample(self, path: Path, prompt: str, step: int) -> None:
        self._line(f"[tempera] sample at step {step}: {path}")

    def on_compile(self, event: CompileEvent) -> None:
        seconds = f" ({event.seconds:.1f} s)" if event.seconds else ""
        self._line(f"[compile:{event.kind}] {event.component}: {event.message}{seconds}")

    def on_saved(self, path: Path, step: int) -> None:
        self._line(f"[tempera] saved {path} at step {step}")

    def on_validation(self, score: ValidationScore) -> None:
        pass  # the trainer's status line says it ("validation loss ... at step ...")

    def on_error(self, message: str) -> None:
        tqdm.write(f"[tempera] error: {message}", file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
