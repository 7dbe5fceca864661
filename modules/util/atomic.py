"""Atomic file writes: a crash or error mid-write never leaves a truncated file in place."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to `path` through a temporary file in the same folder and `os.replace`."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_dir(path: Path, write: Callable[[Path], None]) -> None:
    """Build a folder with `write(tmp_dir)` next to `path`, then swap it into place.

    The previous folder (if any) is kept until the new one is complete, so an interrupted save
    leaves the old, good folder where it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    old = path.with_name(f".{path.name}.old")
    try:
        write(tmp)
        if old.exists():
            shutil.rmtree(old)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        if old.exists():
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
