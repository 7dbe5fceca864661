"""Where a LoRA tool writes: a new path in a folder this user can write, with room for what is
written, checked before any heavy work; and an OS error while writing (a full disk, a folder
made read-only meanwhile) refused in one line naming the output, as the trainer refuses an
unwritable output folder (`modules/train/setup/inputs.py`). The writes themselves are atomic
(`modules/util/atomic.py`: a temporary file or folder beside the output, renamed when
complete, removed on error), so a refused write leaves nothing behind.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from modules.lora_tools.errors import input_error
from modules.util.disk import free_bytes, is_disk_full, megabytes


def check_new_output(path: str | Path, needed_bytes: int = 0) -> Path:
    """The output path, refused when something is already there (nothing is overwritten),
    when its folder is missing or cannot be written, or when its disk has less free space than
    `needed_bytes` (what the tool will write, when it is large enough to matter)."""
    path = Path(path)
    if path.exists():
        raise input_error("{output} {path}: already exists; choose a new path (nothing was "
                          "overwritten)", path=path)
    folder = path.parent
    if not folder.is_dir():
        raise input_error("{output} {path}: the folder {folder} does not exist", path=path,
                          folder=folder)
    if not os.access(folder, os.W_OK | os.X_OK):
        reason = ("it is on a read-only file system" if _read_only(folder)
                  else "this user may not write there")
        raise input_error("{output} {path}: cannot be written: {folder}: {reason}; nothing was "
                          "written", path=path, folder=folder, reason=reason)
    free = free_bytes(folder)
    if free < needed_bytes:
        raise input_error("{output} {path}: about {needed} needed, {free} free on the disk of "
                          "{folder}; nothing was written", path=path, folder=folder,
                          needed=megabytes(needed_bytes), free=megabytes(free))
    return path


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Around an atomic write of `path`: a full disk, or an OS error on the output's folder
    (its temporary file), becomes one refusal naming the output. An OS error on another file
    (a base model being read) is not the output's and goes on as it is."""
    try:
        yield
    except Exception as error:
        if is_disk_full(error):
            raise input_error("{output} {path}: the disk ran out of space while writing it "
                              "({free} free now); nothing was written", path=path,
                              free=megabytes(free_bytes(path.parent))) from error
        if isinstance(error, OSError) and _about_output(error, path):
            raise input_error("{output} {path}: cannot be written ({reason}); nothing was "
                              "written", path=path,
                              reason=os.strerror(error.errno) if error.errno
                              else str(error)) from error
        raise


def _about_output(error: OSError, output: Path) -> bool:
    """Whether an OS error is the output's: about its atomic write's temporary file or folder
    (`.<name>.<random>.tmp` beside it) or itself, or naming no file, as a failed write to an
    open file does (its errno then says it is a write's)."""
    if error.filename is None:
        return error.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG)
    folder = output.absolute().parent
    path = Path(os.fsdecode(error.filename)).absolute()
    return any(part.parent == folder and (part.name == output.name
                                          or part.name.startswith(f".{output.name}."))
               for part in (path, *path.parents))
