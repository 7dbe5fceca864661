"""Records any GUI update that runs off the Tk thread (tests assert there are none)."""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any


class ThreadGuard:
    def __init__(self) -> None:
        self.tk_thread = threading.current_thread()
        self.violations: list[str] = []

    def check(self, where: str) -> None:
        current = threading.current_thread()
        if current is not self.tk_thread:
            self.violations.append(f"{where} ran on thread {current.name!r}")


def tk_thread_only(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a method of an object with a `guard` attribute: record off-thread calls."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.guard.check(method.__qualname__)
        return method(self, *args, **kwargs)
    return wrapper
