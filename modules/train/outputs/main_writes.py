"""The files rank 0 alone writes while several processes train (samples, checkpoints, final/,
best/, backups), with their outcome agreed over the ranks.

Without the agreement a write that fails on rank 0 stops rank 0 alone: the other ranks go on
into the next collective (the next step's gradient exchange, a sharded forward) and wait there
until the process group's timeout, with no word of why. Every rank calls `agreed_write` at the
same point instead; rank 0 writes, then one small broadcast hands its outcome to all, so every
rank stops at once with the same message, and what was saved before stays as it was (each save
is atomic: a failed one leaves no half-written file in its place).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

from modules.train.recipe.distributed import Distributed
from modules.util.disk import DiskFull
from modules.util.errors import describe

T = TypeVar("T")


class WriteFailed(Exception):
    """A file rank 0 writes for the run could not be written; under several processes every
    rank raises it, with rank 0's message."""


def agreed_write(dist: Distributed, what: str, write: Callable[[], T]) -> T | None:
    """`write()` on rank 0, its outcome on every rank. One process: `write()` as it is (its
    own exception, unchanged). Several: every rank calls this at the same point; rank 0 runs
    `write`, the others only take part in the broadcast of how it went. When rank 0's write
    raised, every rank raises the same error naming `what` and the cause: DiskFull for a full
    disk (no backup is tried after it), WriteFailed otherwise. Returns what `write` returned
    (rank 0), None on the other ranks."""
    if not dist.enabled:
        return write()
    result: T | None = None
    failure: Exception | None = None
    if dist.is_main:
        try:
            result = write()
        except Exception as exc:  # noqa: BLE001 - every rank raises it, below
            failure = exc
    outcome = dist.from_main(None if failure is None else (
        f"rank 0 could not write {what} ({describe(failure)}); every process stopped",
        isinstance(failure, DiskFull)))
    if outcome is None:
        return result
    message, disk_full = cast(tuple[str, bool], outcome)  # rank 0's, broadcast
    error = DiskFull(message) if disk_full else WriteFailed(message)
    if failure is not None:
        raise error from failure
    raise error
