"""A full or unwritable disk during a save, reported with the path and the space it needs."""
from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from modules.util.errors import error_chain

T = TypeVar("T")


class DiskFull(Exception):
    """A save did not fit on its disk; what was saved before it is intact."""


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (where a folder about to be made would go)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Free space on the disk that holds `path` (or its nearest existing parent)."""
    return shutil.disk_usage(nearest_existing(path)).free


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` is (or wraps) "no space left on device", also as safetensors reports it
    (its own error type, with the OS error only in the text)."""
    for e in error_chain(err):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e).lower()
        if "no space left on device" in text or "os error 28" in text:
            return True
    return False


def megabytes(count: int) -> str:
    return f"{count / 2**20:,.0f} MB"


def guarded_write(write: Callable[[], T], path: Path, needed_bytes: int) -> T:
    """Run `write` (an atomic save into `path`); a full disk becomes DiskFull naming the path,
    the space it needs and the space left."""
    try:
        return write()
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        raise DiskFull(f"no space left on the disk of {path} while saving: about "
                       f"{megabytes(needed_bytes)} needed, {megabytes(free_bytes(path))} free. "
                       "Earlier saves are intact; free space, then resume") from exc
