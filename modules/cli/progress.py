"""Clean progress for runs nobody watches live (cloud runs): a line per N seconds and a JSON file.

`ProgressReporter` wraps the trainer's callbacks object (modules/events.py): every event goes on
to the wrapped callbacks; at most every `every` seconds (and at the last step) it writes one
plain line to the log and `progress.json` atomically: step/total, loss, it/s, ETA and the latest
compile status. `tempera-cloud status` reads that file. `watch_stop_file` turns a file appearing
into a stop request (`tempera-cloud cancel`).
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from modules.events import CompileEvent, Progress, TrainerCommands, ValidationScore
from modules.util.atomic import atomic_write_text
from modules.util.duration import format_duration


def progress_line(data: dict) -> str:
    """`step 120/1000 (12%)  loss 0.1234  2.50 it/s  ETA 5:52  compile: UNet done`"""
    total = data.get("max_steps") or 0
    percent = f" ({100 * data['step'] // total}%)" if total else ""
    loss = data.get("loss")
    parts = [f"step {data['step']}/{total or '?'}{percent}",
             f"loss {loss:.4f}" if isinstance(loss, (int, float)) else "loss ?",
             f"{data['it_per_s']:.2f} it/s" if data.get("it_per_s") else "? it/s",
             f"ETA {format_duration(data.get('eta_seconds'))}"]
    if data.get("compile"):
        parts.append(f"compile: {data['compile']}")
    return "  ".join(parts)


class ProgressReporter:
    """Trainer callbacks that forward everything and report progress every `every` seconds."""

    def __init__(self, inner, path: Path, every: float, stream: TextIO | None = None,
                 clock=time.monotonic) -> None:
        self.inner, self.path, self.every = inner, Path(path), float(every)
        self.stream = stream or sys.stderr
        self.clock = clock
        self.last_report: float | None = None
        self.compile_status = ""
        self.latest: dict | None = None

    def __getattr__(self, name):  # close() and anything else the wrapped callbacks have
        return getattr(self.inner, name)

    def on_status(self, text: str) -> None:
        self.inner.on_status(text)

    def on_sample(self, path: Path, prompt: str, step: int) -> None:
        self.inner.on_sample(path, prompt, step)

    def on_saved(self, path: Path, step: int) -> None:
        self.inner.on_saved(path, step)

    def on_error(self, message: str) -> None:
        self.inner.on_error(message)

    def on_validation(self, score: ValidationScore) -> None:
        self.inner.on_validation(score)

    def on_compile(self, event: CompileEvent) -> None:
        self.inner.on_compile(event)
        self.compile_status = f"{event.component} {event.kind}: {event.message}"[:120]
        if self.latest is not None:
            self.latest["compile"] = self.compile_status
        # Before the first step too: a run stopped during its first compile says where it was.
        self._write(self.latest or {"step": 0, "max_steps": None, "compile": self.compile_status})

    def on_progress(self, progress: Progress) -> None:
        self.inner.on_progress(progress)
        spp = progress.seconds_per_step
        self.latest = {"step": progress.step, "max_steps": progress.max_steps,
                       "epoch": progress.epoch, "max_epochs": progress.max_epochs,
                       "loss": progress.smoothed_loss, "lr": progress.lr,
                       "it_per_s": 1.0 / spp if spp and spp > 0 else None,
                       "eta_seconds": progress.eta_seconds, "compile": self.compile_status}
        now = self.clock()
        due = self.last_report is None or now - self.last_report >= self.every
        if due or progress.step >= progress.max_steps:
            self.last_report = now
            print(f"[progress] {progress_line(self.latest)}", file=self.stream, flush=True)
            self._write(self.latest)

    def _write(self, data: dict) -> None:
        atomic_write_text(self.path, json.dumps({**data, "updated_at": time.time()}) + "\n")


def watch_stop_file(path: Path, commands: TrainerCommands, on_stop, poll: float = 1.0
                    ) -> threading.Event:
    """Request a stop (with a save) once `path` exists; set the returned event to end the watch."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll):
            if Path(path).exists():
                on_stop(f"stop file {path} appeared: finishing the step and saving")
                commands.request_stop()
                return

    threading.Thread(target=watch, name="stop-file-watch", daemon=True).start()
    return done
