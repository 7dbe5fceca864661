"""One run per output folder: a lock file held (flock) by the training process while it runs.

The operating system drops an flock when its process dies, however it dies (kill -9, a reboot),
so a lock left by a dead run is never mistaken for a live one: the next run takes it over and
says whose it was. The file holds the owner's pid, host and start time for the message.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".tempera.lock"


class OutputBusy(Exception):
    """Another live process trains into this output folder."""


def _owner(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        return {}


def describe_owner(owner: dict) -> str:
    return (f"pid {owner.get('pid', '?')} on {owner.get('host', '?')} since "
            f"{owner.get('started', '?')}")


def busy_message(output_dir: Path) -> str | None:
    """Why `output_dir` cannot be trained into now (another live run holds it), or None.

    Opens the lock file read-only and writes nothing, so a refused start leaves no trace.
    """
    path = Path(output_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return f"another training is writing into it ({describe_owner(_owner(path))})"
    finally:
        os.close(fd)
    return None


class OutputLock:
    """Held from the first file a run writes until it ends."""

    def __init__(self, output_dir: Path) -> None:
        self.path = Path(output_dir) / LOCK_NAME
        self.fd: int | None = None
        self.previous: dict = {}

    def acquire(self) -> "OutputLock":
        """Take the lock or raise OutputBusy; `previous` is a dead owner's record, if any."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputBusy(f"{self.path.parent}: another training is writing into it "
                             f"({describe_owner(_owner(self.path))})") from None
        self.previous = _owner(self.path)
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
