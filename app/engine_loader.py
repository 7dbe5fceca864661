"""The training engine (torch and the compile engine) imported off the Tk thread.

Importing torch takes seconds (12 s on a loaded machine). Done on the Tk thread it froze the
window, an empty grey rectangle whose clicks took effect once torch was in; done here the window
stays drawn and editable meanwhile, and the outcome arrives on the window's event queue as an
`Event(EVENT, (ok, value))` (value: the exception when it failed) that the window hands back to
`finished` on the Tk thread.

No tkinter here. The import holds the interpreter lock for most of its time, but Python hands
the lock to the Tk thread every few milliseconds: the window's longest pause while torch loads
is a fraction of a second (a large shared library opening), not the whole import.
"""
from __future__ import annotations

import gc
import queue
import threading
from collections.abc import Callable
from typing import Any

from app.runner import Event, run_in_thread

EVENT = "engine"  # the kind of the event that says the engine was imported (or failed to be)
LOADING = "the training engine (torch) is still loading"


class EngineLoader:
    """Imports the engine once, in a thread (`start`); `ready` once the Tk thread has taken
    a successful outcome (`finished`), `done` once it has taken either."""

    def __init__(self, load: Callable[[], None], events: "queue.Queue[Event]") -> None:
        self.load, self.events = load, events
        self.ready = self.done = self.closed = False
        self.thread: threading.Thread | None = None
        self._gc_was_enabled = False
        self._lock = threading.Lock()
        self._ended: set[str] = set()  # "import" and "window" once each has ended

    @property
    def loading(self) -> bool:
        return self.thread is not None and not self.done

    def start(self, then: Callable[[], Any] = lambda: None) -> None:
        """Import in a thread. The garbage collector is off until `finished` runs on the Tk
        thread: a collection inside the import would run in this thread and could finalize a
        Tk object left in a reference cycle (a destroyed row's variables, a font), and
        tkinter hands such a call to the Tk thread and waits for it, so the import would stall
        on the window (and deadlock if the Tk thread waited for one of the modules this thread
        is importing). Reference counting still frees everything else.

        `then` runs in the thread after the import (what else the window would otherwise do on
        its own thread with torch: detect what this machine can compile with); its result is
        the event's value."""
        if self.thread is not None:
            return
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        def work() -> Any:
            try:
                self.load()
                return then()
            finally:
                self._release("import")
        self.thread = run_in_thread(work, self.events, EVENT)

    def finished(self, ok: bool) -> None:
        """On the Tk thread, when the outcome arrived: the collector is on again."""
        self.ready, self.done = ok, True
        self._release("window")

    def close(self) -> None:
        """The window closes without waiting for an import still running: the collector is
        on again once both have ended (no Tk thread is left to wait for)."""
        self.closed = True
        if self.thread is not None:
            self._release("window")

    def _release(self, side: str) -> None:
        with self._lock:
            self._ended.add(side)
            if self._ended == {"import", "window"} and self._gc_was_enabled:
                self._gc_was_enabled = False
                gc.enable()
