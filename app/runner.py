"""Run the trainer off the Tk thread. Callbacks only put events on a queue; the window drains it.

No tkinter here: the worker thread must never touch a widget, so it has none to touch.
"""
from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modules.config import Config, ConfigError
from modules.events import CompileEvent, Progress, TrainerCommands, ValidationScore


@dataclass(frozen=True)
class Event:
    kind: str   # status | progress | sample | compile | saved | validation | error | done
                # | config_error | failed | crashed | exit | report
    payload: Any = None


class QueueCallbacks:
    """TrainerCallbacks that forward every event to a queue (thread-safe, widget-free)."""

    def __init__(self, events: "queue.Queue[Event]") -> None:
        self.events = events

    def on_status(self, text: str) -> None:
        self.events.put(Event("status", text))

    def on_progress(self, progress: Progress) -> None:
        self.events.put(Event("progress", progress))

    def on_sample(self, path: Path, prompt: str, step: int) -> None:
        self.events.put(Event("sample", (Path(path), prompt, step)))

    def on_compile(self, event: CompileEvent) -> None:
        self.events.put(Event("compile", event))

    def on_saved(self, path: Path, step: int) -> None:
        self.events.put(Event("saved", (Path(path), step)))

    def on_validation(self, score: ValidationScore) -> None:
        self.events.put(Event("validation", score))

    def on_error(self, message: str) -> None:
        self.events.put(Event("error", message))


TrainFn = Callable[[Config, QueueCallbacks, TrainerCommands], Any]


def engine_train() -> TrainFn:
    """The engine's `train`, imported when a run starts (the window opens without torch)."""
    from modules.frontend import train
    return train


class TrainingWorker:
    """One training run in a daemon thread; its outcome arrives as a final queue event."""

    def __init__(self, config: Config, events: "queue.Queue[Event]",
                 train_fn: TrainFn | None = None) -> None:
        self.config = config
        self.events = events
        self.commands = TrainerCommands()
        self.train_fn = train_fn
        self.thread = threading.Thread(target=self._run, name="tempera-trainer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def _run(self) -> None:
        callbacks = QueueCallbacks(self.events)
        try:
            train_fn = self.train_fn or engine_train()
            result = train_fn(self.config, callbacks, self.commands)
            self.events.put(Event("done", result))
        except ConfigError as exc:
            self.events.put(Event("config_error", exc.problems))
        except Exception as exc:  # reported in the window, never swallowed
            if type(exc).__name__ == "TrainingError":
                self.events.put(Event("failed", str(exc)))
            else:
                self.events.put(Event("crashed", "".join(traceback.format_exception(exc))))
        finally:
            self.events.put(Event("exit"))


def run_in_thread(fn: Callable[[], Any], events: "queue.Queue[Event]", kind: str) -> threading.Thread:
    """Call fn() in a daemon thread; the outcome arrives as Event(kind, (ok, value)).

    value is fn's result, or on failure the exception itself (a ConfigError's problems are
    listed by the window; anything else is shown with its traceback).
    """
    def target() -> None:
        try:
            events.put(Event(kind, (True, fn())))
        except Exception as exc:  # shown to the user by the window
            # read back with getattr (compile_check.py): not an attribute Exception declares
            setattr(exc, "formatted_traceback", "".join(traceback.format_exception(exc)))
            events.put(Event(kind, (False, exc)))
    thread = threading.Thread(target=target, name=f"tempera-{kind}", daemon=True)
    thread.start()
    return thread
