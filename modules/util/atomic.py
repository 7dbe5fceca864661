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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """`atomic_write_text` for bytes."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


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


def publish_dir_once(target: Path, build: Callable[[Path], object]) -> Path:
    """Build a folder with `build(tmp_dir)` next to `target`, then rename it to `target`.

    For caches whose contents depend only on their name (built-in models, datasets): if
    another process published `target` first, its folder is kept and ours is discarded, and an
    interrupted build leaves nothing under `target`, so it is simply redone next time.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():  # a concurrent build of the same name won the rename
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target
