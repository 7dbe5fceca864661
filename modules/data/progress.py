"""A status line for long passes over many images (scanning, latent caching): count, rate and
ETA, said at most every few seconds so a 20,000-image folder does not flood the log."""
from __future__ import annotations

import time
from collections.abc import Callable

from modules.util.duration import format_duration

ProgressCallback = Callable[[int, int], None]  # (done, total)


class RateMeter:
    """`meter(done, total)` calls `say` with "<what>: 1,234/20,000 images (6 %), 85/s, ETA
    3:17" on the first call, every `every` seconds after, and at the end."""

    def __init__(self, what: str, say: Callable[[str], None], every: float = 2.0,
                 unit: str = "images", clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.say, self.every, self.unit, self.clock = what, say, every, unit, clock
        self.started = clock()
        self.last_said: float | None = None

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        finished = done >= total
        if not finished and self.last_said is not None and now - self.last_said < self.every:
            return
        self.last_said = now
        self.say(self.line(done, total, now - self.started))

    def line(self, done: int, total: int, seconds: float) -> str:
        percent = f" ({100 * done // total} %)" if total else ""
        text = f"{self.what}: {done:,}/{total:,} {self.unit}{percent}"
        if seconds > 0 and done:
            rate = done / seconds
            text += f", {rate:,.0f}/s"
            if done < total:
                text += f", ETA {format_duration((total - done) / rate)}"
        return text
