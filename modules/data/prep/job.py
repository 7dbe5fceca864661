"""A preparation job over a dataset folder: every image, in batches, through one model, each
result written beside its image. Shared by the captioner and the mask maker.

A job is data (`FolderJob`) run by one function (`run_job`):

    job = FolderJob(kind="caption", settings={...}, load=load_model,
                    needs_work=why_left_alone, write=write_result, batch_size=8)
    report = run_job(folder, job, JobHooks(progress=..., status=...), stop=threading.Event())

- `load()` returns the model as a `BatchModel` (`process(images) -> one result per image`). It
  is called once, after the folder is locked and only when some image needs work, and the model
  is released when the job ends however it ends (`close()` if it has one, the last reference
  dropped, the CUDA cache emptied), so a job never holds a model beside a training run. A
  problem the user must fix (weights not cached while offline, a damaged model file) is raised
  from `load` as `JobRefused`.
- `needs_work(image)` is None for an image to process, or why it is left alone ("has a caption").
- `write(image, result)` writes one image's files and returns them. It must write each file
  whole or not at all (`modules.util.atomic.atomic_write_text` / `atomic_file`: a temporary file
  and `os.replace`), so Stop or a crash never leaves half a file. The job calls it on the
  calling thread, never concurrently.
- `settings` (JSON-able) says what the job does; a re-run continues a stopped job only when
  they are the same.

What the job guarantees:

- **One job per folder.** A lock file (`LOCK_NAME`) in the folder names the running job; a
  second job on the folder is refused with `JobRefused` saying which job holds it (a lock left by
  a process that no longer runs on this machine is taken over, and said so).
- **Stop and continue.** `stop` (a `threading.Event`) is read before each batch; the batch
  being processed is finished and written, then the job ends with status "stopped". A journal
  (`journal_name(kind)`, one line per finished image) lets the next run with the same settings
  skip what is done; it is removed when the job finishes.
- **Bad input is named, never fatal.** Unreadable and zero-byte images are skipped with the
  reason; an image the model fails on is retried alone and, if it fails again, named with the
  error while the job goes on. Only a model that fails on each of the first `FAIL_FAST_AFTER`
  images, or a file that cannot be written, ends the job (status "failed"; finished files stay).
- **Refusals before anything is written.** A missing folder, a folder that is not writable, no
  images, a held lock: `JobRefused`, with one sentence saying what to do.
- **Progress.** `hooks.progress(JobProgress)` after every image (count, total, ETA from the
  images done so far, the model's loading time left out); `hooks.status(text)` for lines such as
  "loading Florence-2". Hooks run on the job's thread: a window hands them to its own thread.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from PIL import Image

from modules.data.errors import DatasetError
from modules.data.file_kinds import split_masks
from modules.data.images import is_image_file, open_rgb

LOCK_NAME = ".tempera-prep.lock"
# A model that fails on each of this many first images is broken, not the images: the job ends
# instead of naming every image of the folder as failed.
FAIL_FAST_AFTER = 5
_LISTED = 5  # names a report line lists before "..."


class JobRefused(Exception):
    """The job cannot start (or load its model); the message says what to do. Nothing written."""


class BatchModel(Protocol):
    def process(self, images: Sequence[Image.Image]) -> Sequence[Any]:
        """One result per image, in order; raises when the model fails on the batch."""
        ...


@dataclass(frozen=True)
class FolderJob:
    """What a job does to each image (see the module docstring)."""
    kind: str                                  # "caption", "mask": names messages and the journal
    settings: Mapping[str, Any]                # JSON-able; a re-run continues only when equal
    load: Callable[[], BatchModel]
    needs_work: Callable[[Path], str | None]   # None: process it; else why it is left alone
    write: Callable[[Path, Any], list[Path]]   # writes one image's files atomically, returns them
    batch_size: int = 4
    recursive: bool = False                    # subfolders too (kohya's `10_name` folders)


@dataclass(frozen=True)
class JobProgress:
    done: int                  # images handled in this run (written, skipped or failed)
    total: int                 # images this run has to handle
    written: int
    skipped: int               # unreadable images
    failed: int                # images the model failed on
    current: Path | None       # the image just handled
    elapsed: float             # seconds since the first batch began (model loading excluded)
    eta_seconds: float | None  # None until an image is done


def _ignore(_value: Any) -> None:
    return None


@dataclass(frozen=True)
class JobHooks:
    """How a job talks to its front end; both run on the job's thread."""
    progress: Callable[[JobProgress], None] = _ignore
    status: Callable[[str], None] = _ignore


@dataclass
class JobReport:
    """What a job did. `status`: "finished", "stopped" or "failed" (`error` says why)."""
    kind: str
    folder: Path
    status: str = "finished"
    written: list[Path] = field(default_factory=list)          # files written
    processed: list[Path] = field(default_factory=list)        # images done in this run
    earlier: int = 0                                           # done by the stopped run before
    left_alone: list[tuple[Path, str]] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # unreadable images
    failed: list[tuple[Path, str]] = field(default_factory=list)   # the model failed on them
    error: str = ""
    seconds: float = 0.0

    def lines(self) -> list[str]:
        """The report as short lines for a terminal or a dialog."""
        out = [f"{self.kind} job {self.status}: {len(self.processed)} image(s) done, "
               f"{len(self.written)} file(s) written in {self.folder}"]
        if self.error:
            out.append(f"error: {self.error}")
        if self.earlier:
            out.append(f"{self.earlier} image(s) were done by the earlier, stopped job")
        if self.left_alone:
            reasons = sorted({reason for _, reason in self.left_alone})
            out.append(f"{len(self.left_alone)} image(s) left alone ({'; '.join(reasons)})")
        for label, entries in (("skipped (unreadable)", self.skipped),
                               ("failed (the model's error)", self.failed)):
            if entries:
                out.append(f"{len(entries)} image(s) {label}:")
                out += [f"  {path.name}: {reason}" for path, reason in entries]
        if self.status == "stopped":
            out.append("run the same job again to continue where it stopped")
        return out


def journal_name(kind: str) -> str:
    """The journal's file name in the folder (hidden, so no scan lists it)."""
    return f".tempera-{kind}-journal.jsonl"


def list_images(folder: Path, recursive: bool) -> list[Path]:
    """The folder's trainable images (loss masks and hidden files left out), sorted by
    relative path as the dataset scan sorts them."""
    candidates = folder.rglob("*") if recursive else folder.iterdir()
    files = sorted((p for p in candidates if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(folder).parts)),
        key=lambda p: p.relative_to(folder).as_posix())
    images, _masks = split_masks(files, [p for p in files if is_image_file(p)])
    return images


def run_job(folder: Path, job: FolderJob, hooks: JobHooks = JobHooks(),
            stop: threading.Event | None = None) -> JobReport:
    """Run `job` over `folder`'s images; see the module docstring. Raises JobRefused when it
    cannot start; otherwise returns the report, also when stopped or failed."""
    folder = Path(folder)
    _check_folder(folder)
    images = list_images(folder, job.recursive)
    if not images:
        raise JobRefused(f"{folder} holds no images (.jpg, .jpeg, .png, .webp)")
    stop = stop or threading.Event()
    started = time.monotonic()
    with FolderLock(folder, job.kind, hooks.status):
        journal = Journal(folder / journal_name(job.kind), dict(job.settings), hooks.status)
        report = JobReport(job.kind, folder)
        try:
            todo = _plan(folder, images, job, journal, report)
            if todo and not stop.is_set():
                _process(todo, job, journal, report, hooks, stop)
            elif todo:
                report.status = "stopped"
        finally:
            journal.close()
        if report.status == "finished":
            journal.remove()
    report.seconds = time.monotonic() - started
    return report


def _check_folder(folder: Path) -> None:
    if not folder.exists():
        raise JobRefused(f"{folder} does not exist")
    if not folder.is_dir():
        raise JobRefused(f"{folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise JobRefused(f"{folder} is not writable: give yourself write permission on it "
                         "(or copy the dataset somewhere writable); nothing was written")


def _plan(folder: Path, images: list[Path], job: FolderJob, journal: Journal,
          report: JobReport) -> list[Path]:
    """The images this run processes; the rest go into the report as earlier or left alone."""
    todo = []
    for image in images:
        if journal.has(image.relative_to(folder).as_posix()):
            report.earlier += 1
            continue
        reason = job.needs_work(image)
        if reason is None:
            todo.append(image)
        else:
            report.left_alone.append((image, reason))
    return todo


def _process(todo: list[Path], job: FolderJob, journal: Journal, report: JobReport,
             hooks: JobHooks, stop: threading.Event) -> None:
    hooks.status(f"{job.kind}: loading the model for {len(todo)} image(s)")
    model: BatchModel | None = job.load()
    try:
        meter = _Meter(len(todo), report, hooks)
        for start in range(0, len(todo), max(1, job.batch_size)):
            if stop.is_set():
                report.status = "stopped"
                return
            assert model is not None
            if not _run_batch(model, todo[start:start + job.batch_size], job, journal,
                              report, meter):
                return
    finally:
        close = getattr(model, "close", None)
        if callable(close):
            close()
        model = None
        release_memory()


def _run_batch(model: BatchModel, paths: list[Path], job: FolderJob, journal: Journal,
               report: JobReport, meter: _Meter) -> bool:
    """Process and write one batch; False when the job must end (report.status says why)."""
    loaded: list[tuple[Path, Image.Image]] = []
    for path in paths:
        image, reason = load_image(path)
        if image is None:
            report.skipped.append((path, reason))
            meter.tick(path)
        else:
            loaded.append((path, image))
    for path, result in _results(model, loaded, report, meter):
        try:
            report.written += job.write(path, result)
        except OSError as exc:
            report.status = "failed"
            report.error = (f"cannot write the result for {path}: {exc}; the files written "
                            "before are whole; run the job again to continue")
            return False
        journal.add(path.relative_to(report.folder).as_posix())
        report.processed.append(path)
        meter.tick(path)
    if not report.processed and len(report.failed) >= FAIL_FAST_AFTER:
        report.status = "failed"
        report.error = (f"the model failed on each of the first {len(report.failed)} images "
                        f"(the last: {report.failed[-1][1]}); nothing is wrong with the images "
                        "that many, so the model or its settings are")
        return False
    return True


def _results(model: BatchModel, loaded: list[tuple[Path, Image.Image]], report: JobReport,
             meter: _Meter) -> list[tuple[Path, Any]]:
    """(image, result) for each image the model handled; a failing batch is retried one image
    at a time so the image it fails on is named and the others still get their results."""
    if not loaded:
        return []
    try:
        results = list(model.process([image for _, image in loaded]))
    except Exception as exc:  # noqa: BLE001 - retried per image, then named in the report
        if len(loaded) == 1:
            report.failed.append((loaded[0][0], describe_error(exc)))
            meter.tick(loaded[0][0])
            return []
        out = []
        for one in loaded:
            out += _results(model, [one], report, meter)
        return out
    if len(results) != len(loaded):
        raise RuntimeError(f"the model returned {len(results)} results for {len(loaded)} images")
    return [(path, result) for (path, _), result in zip(loaded, results)]


def load_image(path: Path) -> tuple[Image.Image | None, str]:
    """(the image as RGB with its EXIF orientation, "") or (None, why it cannot be read)."""
    try:
        if path.stat().st_size == 0:
            return None, "empty file (0 bytes)"
        return open_rgb(path), ""
    except OSError as exc:
        return None, f"cannot be read ({exc})"
    except DatasetError as exc:
        cause = exc.__cause__
        return None, ("not a readable image (" + (describe_error(cause) if cause else str(exc))
                      + ")")


def describe_error(exc: BaseException) -> str:
    """`TypeName: message` on one line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def release_memory() -> None:
    """Free a released model's memory now: collect it, and give the CUDA cache back so a
    training run started next finds the card empty."""
    gc.collect()
    torch = sys.modules.get("torch")  # never import torch just to empty a cache
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Meter:
    """Counts handled images and calls hooks.progress with the ETA after each."""

    def __init__(self, total: int, report: JobReport, hooks: JobHooks) -> None:
        self.total, self.report, self.hooks = total, report, hooks
        self.done = 0
        self.started = time.monotonic()

    def tick(self, path: Path) -> None:
        self.done += 1
        elapsed = time.monotonic() - self.started
        eta = elapsed / self.done * (self.total - self.done)
        report = self.report
        self.hooks.progress(JobProgress(self.done, self.total, len(report.processed),
                                        len(report.skipped), len(report.failed), path, elapsed,
                                        eta))


class Journal:
    """The images a job finished, one JSON line each after a header with the job's settings.

    An append-only file: a line cut short by a crash is ignored when read. A journal written
    with other settings is set aside (the job starts over) and said so."""

    def __init__(self, path: Path, settings: dict[str, Any],
                 status: Callable[[str], None]) -> None:
        self.path, self.settings = path, json.loads(json.dumps(settings))
        self.done: set[str] = set()
        if path.exists():
            self._read(status)
        self._file: Any = None

    def _read(self, status: Callable[[str], None]) -> None:
        lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        entries = []
        for line in lines:
            try:
                entries.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a crash
        header = entries[0] if entries and isinstance(entries[0], dict) else {}
        if header.get("settings") != self.settings:
            status(f"a job with other settings stopped in this folder; starting over with "
                   f"these settings ({self.path.name} replaced)")
            self.path.unlink()
            return
        self.done = {e["done"] for e in entries[1:]
                     if isinstance(e, dict) and isinstance(e.get("done"), str)}
        status(f"continuing the stopped job: {len(self.done)} image(s) already done")

    def has(self, relative: str) -> bool:
        return relative in self.done

    def add(self, relative: str) -> None:
        if self._file is None:
            new = not self.path.exists()
            self._file = open(self.path, "a", encoding="utf-8")
            if new:
                self._write({"settings": self.settings})
        self._write({"done": relative})
        self.done.add(relative)

    def _write(self, entry: dict[str, Any]) -> None:
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        self.close()
        if self.path.exists():
            self.path.unlink()


class FolderLock:
    """`with FolderLock(folder, kind, status):` — one preparation job per folder at a time."""

    def __init__(self, folder: Path, kind: str, status: Callable[[str], None]) -> None:
        self.path, self.kind, self.status = folder / LOCK_NAME, kind, status
        self.held = False

    def __enter__(self) -> FolderLock:
        for _attempt in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._refuse_or_take_over()
                continue
            except OSError as exc:
                raise JobRefused(f"{self.path.parent} is not writable ({exc}); nothing was "
                                 "written") from exc
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                json.dump({"kind": self.kind, "pid": os.getpid(), "host": socket.gethostname(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S")}, file)
            self.held = True
            return self
        raise JobRefused(f"could not lock {self.path.parent}: another job keeps locking it")

    def _refuse_or_take_over(self) -> None:
        """Raise JobRefused naming the job that holds the lock; remove a stale lock."""
        try:
            holder = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            holder = {}
        if not isinstance(holder, dict):
            holder = {}
        pid, host = holder.get("pid"), holder.get("host")
        if isinstance(pid, int) and host == socket.gethostname() and not _process_alive(pid):
            self.status(f"taking over the lock of a {holder.get('kind', 'preparation')} job "
                        f"that no longer runs (process {pid})")
            self.path.unlink(missing_ok=True)
            return
        who = (f"a {holder.get('kind', 'preparation')} job (process {pid} on {host}, started "
               f"{holder.get('started', '?')})" if pid else "another preparation job")
        raise JobRefused(f"{self.path.parent} is in use by {who}: wait for it to finish or stop "
                         f"it; if none runs, delete {self.path}")

    def __exit__(self, *exc: object) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine. On Windows signal 0 is CTRL_C_EVENT, which
    os.kill would send: there a holder is taken to be alive (the refusal says how to free it)."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, run by someone else
    return True
