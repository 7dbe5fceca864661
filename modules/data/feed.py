"""How long training waits for its next batch: the evidence that the data loader keeps the
(compiled) step fed, or the hint to give it workers when it does not."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

Item = TypeVar("Item")

# Waiting for data longer than this share of the training time is worth a hint.
HINT_SHARE = 0.10


class FeedMeter:
    """Times each `next()` on the loaders it wraps (`timed`); the time the step spent idle,
    waiting for images to be read, decoded and collated (or latents loaded from the cache)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.first_wait: float | None = None  # the loader's start-up (workers spawning)
        self.wait_seconds = 0.0               # every later batch's wait
        self.longest_wait = 0.0
        self.batches = 0

    def timed(self, iterable: Iterable[Item]) -> Iterator[Item]:
        """`iterable`'s items, each timed from asking to getting it."""
        iterator = iter(iterable)
        while True:
            started = self.clock()
            try:
                item = next(iterator)
            except StopIteration:
                return
            self.add(self.clock() - started)
            yield item

    def add(self, waited: float) -> None:
        if self.first_wait is None:
            self.first_wait = waited
            return
        self.wait_seconds += waited
        self.longest_wait = max(self.longest_wait, waited)
        self.batches += 1

    def share(self, training_seconds: float) -> float:
        """The share of `training_seconds` (the steps after the first, waits included: the
        first step's compile and the loader's start-up are left out) spent waiting."""
        return self.wait_seconds / training_seconds if training_seconds > 0 else 0.0

    def report(self, training_seconds: float, workers: int, pin_memory: bool) -> dict:
        """What run.json says about feeding the step."""
        return {"batches_after_the_first": self.batches,
                "first_batch_wait_seconds": round(self.first_wait or 0.0, 4),
                "wait_seconds": round(self.wait_seconds, 4),
                "longest_wait_seconds": round(self.longest_wait, 4),
                "share_of_training_time": round(self.share(training_seconds), 4),
                "workers": workers, "pin_memory": pin_memory}

    def hint(self, training_seconds: float, workers: int, cached_latents: bool) -> str | None:
        """A status line when the step waited for data more than HINT_SHARE of the time."""
        share = self.share(training_seconds)
        if self.batches == 0 or share <= HINT_SHARE:
            return None
        line = (f"training waited for data {100 * share:.0f} % of the time "
                f"({self.wait_seconds:.1f} s over {self.batches} batches)")
        fixes = []
        if workers == 0:
            fixes.append("set data.workers (Dataloader workers) to 2-4")
        if not cached_latents:
            fixes.append("turn on data.cache_latents")
        return line + (": " + " or ".join(fixes) if fixes else "")
