"""The narrow boundary between the trainer and any front end (headless CLI, GUI, cloud hook).

The trainer emits events through a `TrainerCallbacks` object and polls a `TrainerCommands`
object once per step. Neither knows about tkinter: the GUI adapts them onto its Tk-thread queue.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Progress:
    step: int
    max_steps: int
    epoch: int
    max_epochs: int
    loss: float
    smoothed_loss: float
    lr: float
    seconds_per_step: float
    eta_seconds: float               # steps, sampling and validation passes still to come
    sampling_eta_seconds: float = 0.0  # the sampling part of eta_seconds
    validation_eta_seconds: float = 0.0  # the validation part of eta_seconds


@dataclass(frozen=True)
class CompileEvent:
    """Something the compile engine wants the user to see ("compiling UNet: graph 2, 34 s").

    ``message`` is one short sentence for a status line; ``detail`` holds the full text (for
    example dynamo's guard failures) for the log, empty when the message says it all.
    """
    component: str
    message: str
    seconds: float = 0.0
    kind: str = "progress"  # progress | done | fallback | degraded | recompile | warning
    detail: str = ""
    graph: int = 0  # progress: the graphs this component compiled so far (N of "graph N of M")


@dataclass(frozen=True)
class ValidationScore:
    """One validation pass (modules/train/validation/validation.py): its loss at `step` and the best so
    far. A loss that was not finite is None (and never the best)."""
    step: int
    loss: float | None
    best_step: int | None
    best_loss: float | None
    images: int


class TrainerCallbacks(Protocol):
    def on_status(self, text: str) -> None: ...
    def on_progress(self, progress: Progress) -> None: ...
    def on_sample(self, path: Path, prompt: str, step: int) -> None: ...
    def on_compile(self, event: CompileEvent) -> None: ...
    def on_saved(self, path: Path, step: int) -> None: ...
    def on_error(self, message: str) -> None: ...
    def on_validation(self, score: ValidationScore) -> None: ...


class NullCallbacks:
    """Callbacks that drop every event (for tests and library use)."""

    def on_status(self, text: str) -> None:
        pass

    def on_progress(self, progress: Progress) -> None:
        pass

    def on_sample(self, path: Path, prompt: str, step: int) -> None:
        pass

    def on_compile(self, event: CompileEvent) -> None:
        pass

    def on_saved(self, path: Path, step: int) -> None:
        pass

    def on_error(self, message: str) -> None:
        pass

    def on_validation(self, score: ValidationScore) -> None:
        pass


@dataclass
class RecordingCallbacks(NullCallbacks):
    """Callbacks that keep every event in lists (tests, and the run record's event log)."""
    statuses: list[str] = field(default_factory=list)
    progress: list[Progress] = field(default_factory=list)
    samples: list[tuple[Path, str, int]] = field(default_factory=list)
    compile_events: list[CompileEvent] = field(default_factory=list)
    saves: list[tuple[Path, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    validations: list[ValidationScore] = field(default_factory=list)

    def on_status(self, text: str) -> None:
        self.statuses.append(text)

    def on_progress(self, progress: Progress) -> None:
        self.progress.append(progress)

    def on_sample(self, path: Path, prompt: str, step: int) -> None:
        self.samples.append((path, prompt, step))

    def on_compile(self, event: CompileEvent) -> None:
        self.compile_events.append(event)

    def on_saved(self, path: Path, step: int) -> None:
        self.saves.append((path, step))

    def on_error(self, message: str) -> None:
        self.errors.append(message)

    def on_validation(self, score: ValidationScore) -> None:
        self.validations.append(score)


class StopRequested(Exception):
    """Work that runs before or between training steps (latent caching) was abandoned between
    two of its units because the front end asked to stop."""


class TrainerCommands:
    """Thread-safe requests from a front end, polled by the trainer once per step and, for
    Stop, between the units of longer work (denoising steps of a sample, latent batches)."""

    def __init__(self) -> None:
        # Re-entrant: a signal handler (SIGTERM -> request_stop) runs on the main thread,
        # possibly while that thread is inside `stop_requested`; a plain Lock would deadlock.
        self._lock = threading.RLock()
        self._stop = False
        self._save = False
        self._sample = False

    def request_stop(self) -> None:
        with self._lock:
            self._stop = True

    def request_save(self) -> None:
        with self._lock:
            self._save = True

    def request_sample(self) -> None:
        with self._lock:
            self._sample = True

    @property
    def stop_requested(self) -> bool:
        with self._lock:
            return self._stop

    def take_save(self) -> bool:
        """True once per `request_save` call."""
        with self._lock:
            taken, self._save = self._save, False
            return taken

    def take_sample(self) -> bool:
        """True once per `request_sample` call."""
        with self._lock:
            taken, self._sample = self._sample, False
            return taken
