"""Atomic file writes: a crash or error mid-write never leaves a truncated file in place.

The temporary file or folder is made private by `mkstemp` / `mkdtemp` (0600 / 0700); before it
is renamed into place it gets the permissions a plain `open()` / `mkdir()` would have given
(0666 / 0777 minus the umask), so ComfyUI in a container, or another user, can read a save.
"""
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


def current_umask() -> int:
    """The process's umask: read from /proc on Linux; elsewhere reading it means setting it
    (put back at once, a brief window in which another thread's new file gets 022)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_permissions(path: Path) -> None:
    """Give a finished temporary file or folder tree the permissions a normal write would."""
    mask = current_umask()
    if path.is_dir():
        for folder, dirs, files in os.walk(path):
            os.chmod(folder, 0o777 & ~mask)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o666 & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


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
        publish_permissions(tmp)
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
        publish_permissions(tmp)
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
        publish_permissions(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():  # a concurrent build of the same name won the rename
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def is_temporary(path: Path) -> bool:
    """A leftover of an interrupted atomic write in its folder: `.<name>.<random>.tmp` (file or
    folder being written) or `.<name>.old` (a folder being replaced)."""
    return path.name.startswith(".") and path.name.endswith((".tmp", ".old"))


def restore_interrupted_swaps(folders: list[Path]) -> list[Path]:
    """Put back a folder whose replacement was interrupted between `atomic_write_dir`'s two
    renames: `.<name>.old` with no `<name>` beside it is the last complete `<name>`. Returns
    the folders restored. Call it before `remove_temporaries`, which would delete it."""
    restored = []
    for folder in folders:
        for path in sorted(folder.iterdir()) if folder.is_dir() else []:
            if not (path.name.startswith(".") and path.name.endswith(".old") and path.is_dir()
                    and not path.is_symlink()):
                continue
            original = path.with_name(path.name[1:-len(".old")])
            if original.name and not original.exists():
                os.replace(path, original)
                restored.append(original)
    return restored


def remove_temporaries(folders: list[Path]) -> int:
    """Remove the leftovers of interrupted atomic writes directly in `folders`; returns the
    bytes freed. Only call it where no write is under way (e.g. holding the output's lock)."""
    freed = 0
    for folder in folders:
        for path in folder.iterdir() if folder.is_dir() else []:
            if not is_temporary(path):
                continue
            if path.is_dir() and not path.is_symlink():
                freed += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
                shutil.rmtree(path)
            else:
                freed += path.lstat().st_size
                path.unlink()
    return freed
