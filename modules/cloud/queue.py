"""The cloud run queue: one folder and status.json per run, one run at a time under a lock.

```
<work-root>/
  queue.lock                 held by the worker and by the training process it starts
  worker.log                 the background worker's own output
  checkouts/<sha>/           the pushed commit, exported read-only for its runs
  runs/<run-id>/status.json  queued | running | finished | failed | invalid | interrupted |
                             cancelled, with timestamps and the training process's identity
  runs/<run-id>/log.txt      tempera-train's output (a clean progress line every N seconds)
  runs/<run-id>/progress.json  step/total, loss, it/s, ETA, compile status (tempera-train)
  runs/<run-id>/cancel       present: cancel (a queued run never starts, a running one stops)
  outputs/<run-id>/          the run's output.dir (config.json, run.json, weights, samples;
                             bundles/: the compile bundle it wrote, copied there at its end)
```
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from modules.cloud.bundles import (collect_written_bundle, compile_start_summary,
                                   read_compile_bundle)
from modules.cloud.git import clean_git_env
from modules.cloud.supervise import (MAX_RESTARTS, describe_exit, identity, local_is_alive,
                                     restart_command, settle_run_record)
from modules.frontend import read_run_status
from modules.util.atomic import atomic_write_text

QUEUED, RUNNING, FINISHED, FAILED, INVALID = "queued", "running", "finished", "failed", "invalid"
INTERRUPTED, CANCELLED = "interrupted", "cancelled"
DONE_STATES = (FINISHED, FAILED, INVALID, CANCELLED)
STARTABLE = (QUEUED, INTERRUPTED)  # an interrupted run starts again (supervise.restart_command)
PROGRESS_EVERY_SECONDS = 30
# How often the worker looks at a running run's run.json for how it started compiling.
COMPILE_START_POLL_SECONDS = 5.0


@dataclass
class RunStatus:
    """What status.json holds for one run."""
    run_id: str
    state: str
    commit: str
    config: str  # the config's path inside the training repository
    output_dir: str
    log: str
    command: list[str] = field(default_factory=list)  # the exact tempera-train command line
    checkout: str = ""
    ref: str = ""
    exit_code: int | None = None
    error: str = ""
    problems: list[str] = field(default_factory=list)
    queued_at: float = field(default_factory=time.time)
    started_at: float | None = None
    ended_at: float | None = None
    worker_pid: int | None = None
    train_pid: int | None = None  # the training process: pid, boot id, start time (supervise.py)
    boot_id: str = ""
    proc_start: str = ""
    restarts: int = 0
    notes: list[str] = field(default_factory=list)
    # How the run started compiling, from its run.json (modules/cloud/bundles.py): None until
    # the trainer has looked for a compile bundle.
    compile_bundle: dict | None = None

    @classmethod
    def from_dict(cls, data: dict) -> RunStatus:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def run_meta(self) -> dict[str, str]:
        """The facts its run.json keeps under "meta" (see `cloud_run_meta`)."""
        return cloud_run_meta(self.commit, self.config, self.run_id)


def cloud_run_meta(commit: str, config: str, run_id: str) -> dict[str, str]:
    """Where a cloud run came from, as run.json's "meta": handed to tempera-train as
    `--run-meta`, and written by the worker itself when the trainer ended before its record."""
    return {"commit": commit, "config": config, "cloud_run_id": run_id}


def runs_dir(work_root: Path) -> Path:
    return Path(work_root) / "runs"


def status_path(work_root: Path, run_id: str) -> Path:
    return runs_dir(work_root) / run_id / "status.json"


def run_folder(work_root: Path, run_id: str) -> Path:
    return runs_dir(work_root) / run_id


def cancel_path(work_root: Path, run_id: str) -> Path:
    """The cancel marker; also the trainer's --stop-file, so a running run stops with a save."""
    return run_folder(work_root, run_id) / "cancel"


def progress_path(work_root: Path, run_id: str) -> Path:
    return run_folder(work_root, run_id) / "progress.json"


def write_status(work_root: Path, status: RunStatus) -> None:
    atomic_write_text(status_path(work_root, status.run_id),
                      json.dumps(dataclasses.asdict(status), indent=2) + "\n")


def read_status(work_root: Path, run_id: str) -> RunStatus:
    return RunStatus.from_dict(json.loads(status_path(work_root, run_id).read_text("utf-8")))


def list_statuses(work_root: Path) -> list[RunStatus]:
    """Every run's status, oldest first."""
    statuses = [RunStatus.from_dict(json.loads(p.read_text("utf-8")))
                for p in runs_dir(work_root).glob("*/status.json")]
    return sorted(statuses, key=lambda s: (s.queued_at, s.run_id))


def new_run_id(work_root: Path, commit: str, config: str) -> str:
    """A unique, sortable id (`20250102-030405-<sha8>-<config stem>`); its folder is created."""
    stem = "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(config).stem)[:40]
    base = f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{commit[:8]}-{stem}"
    runs_dir(work_root).mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        run_id = base if n == 1 else f"{base}-{n}"
        try:
            (runs_dir(work_root) / run_id).mkdir()
            return run_id
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run id for {base}")


@contextmanager
def queue_lock(work_root: Path, blocking: bool) -> Iterator[int | None]:
    """Hold `<work-root>/queue.lock`; yields its fd, or None at once when it is held elsewhere.

    The fd is handed to each training process (`pass_fds`): an flock belongs to the open file,
    so a training process whose worker was killed still holds the lock and no second training
    starts beside it.
    """
    path = Path(work_root) / "queue.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield None
            return
        try:
            yield handle.fileno()
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def next_queued(work_root: Path) -> RunStatus | None:
    """The oldest run to start; a queued run with a cancel marker is recorded cancelled instead."""
    for status in list_statuses(work_root):
        if status.state not in STARTABLE:
            continue
        if cancel_path(work_root, status.run_id).exists():
            status.state, status.ended_at = CANCELLED, time.time()
            status.error = "cancelled before it started"
            write_status(work_root, status)
            continue
        return status
    return None


def reconcile(work_root: Path) -> list[RunStatus]:
    """`running` runs whose training process is gone: finished if their run.json says so, else
    `interrupted` (to start again) with run.json saying so too. Returns the runs changed."""
    changed = []
    for status in list_statuses(work_root):
        if status.state != RUNNING or local_is_alive(status.train_pid, status.boot_id,
                                                     status.proc_start):
            continue
        record = read_run_status(Path(status.output_dir))
        status.ended_at = time.time()
        if record in ("finished", "stopped"):
            status.state = FINISHED
            status.notes.append("finished while no worker watched it (worker killed)")
        elif cancel_path(work_root, status.run_id).exists():
            status.state, status.error = CANCELLED, "cancelled; the worker was gone when it ended"
            settle_run_record(Path(status.output_dir), CANCELLED, status.error,
                              status.run_meta())
        elif status.restarts >= MAX_RESTARTS:
            status.state = FAILED
            status.error = (f"the training process ended while no worker watched it, "
                            f"{status.restarts + 1} times; not started again (resume it by hand "
                            "with tempera-train --resume)")
            settle_run_record(Path(status.output_dir), FAILED, status.error,
                              status.run_meta())
        else:
            status.state = INTERRUPTED
            status.error = ("the training process ended while no worker watched it (worker "
                            "killed or machine rebooted); it resumes from its last backup")
            settle_run_record(Path(status.output_dir), INTERRUPTED, status.error,
                              status.run_meta())
        settle_bundles(status)
        write_status(work_root, status)
        changed.append(status)
    return changed


def process_queue(work_root: Path, wait_for_lock: bool = False) -> list[str]:
    """Run queued runs one at a time, oldest first, until none is left; return the ids run.

    Without wait_for_lock, returns at once when another worker (or an orphaned training
    process) holds the lock: that worker looks for queued runs again after it releases the
    lock, and an orphan's run is reconciled by the next worker start.
    """
    done: list[str] = []
    while True:
        with queue_lock(work_root, blocking=wait_for_lock) as lock_fd:
            if lock_fd is None:
                return done
            reconcile(work_root)
            while (status := next_queued(work_root)) is not None:
                execute_run(work_root, status, lock_fd)
                done.append(status.run_id)
        if next_queued(work_root) is None:
            return done


def execute_run(work_root: Path, status: RunStatus, lock_fd: int | None = None,
                cancel_grace: float = 5.0) -> RunStatus:
    """Run one run's command with its log file; record running, then how it ended.

    An exception while it runs (the Actions job cancelled: SIGINT/SIGTERM raised as
    KeyboardInterrupt) asks the trainer to stop, ends it after `cancel_grace` seconds, records
    the run `cancelled` and re-raises.
    """
    command = restart_command(status, work_root) if status.state == INTERRUPTED else status.command
    if status.state == INTERRUPTED:
        status.restarts += 1
    status.state, status.started_at, status.worker_pid = RUNNING, time.time(), os.getpid()
    status.exit_code, status.error = None, ""
    log = Path(status.log)
    try:
        with open(log, "ab") as handle:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=handle,
                                    stderr=subprocess.STDOUT, cwd=log.parent, env=clean_git_env(),
                                    pass_fds=() if lock_fd is None else (lock_fd,))
    except OSError as exc:  # the command could not start (moved interpreter, bad --tempera)
        status.state, status.error = FAILED, f"could not start {command[:1]}: {exc}"
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(f"tempera-cloud: {status.error}\n")
        status.ended_at = time.time()
        write_status(work_root, status)
        return status
    found = identity(proc.pid)  # pid, boot id, start time: tells a live run after a reboot
    status.train_pid, status.boot_id, status.proc_start = (found["train_pid"], found["boot_id"],
                                                           found["proc_start"])
    write_status(work_root, status)
    try:
        returncode = wait_noting_compile_start(proc, work_root, status)
    except BaseException:
        cancel_path(work_root, status.run_id).touch()
        stop_process(proc, cancel_grace)
        finish_run(work_root, status, proc.returncode, cancelled=True)
        raise
    finish_run(work_root, status, returncode,
               cancelled=cancel_path(work_root, status.run_id).exists())
    return status


def note_compile_start(status: RunStatus) -> bool:
    """Copy how the run started compiling (warm, cold, mismatch) from its run.json into its
    status, once the trainer has written it; whether the status changed."""
    if status.compile_bundle is not None:
        return False
    known, record = read_compile_bundle(Path(status.output_dir))
    if known:
        status.compile_bundle = compile_start_summary(record)
    return known


def wait_noting_compile_start(proc: subprocess.Popen, work_root: Path, status: RunStatus,
                              poll: float = COMPILE_START_POLL_SECONDS) -> int:
    """Wait for the trainer; meanwhile record in status.json how it started compiling, so
    `status` (over ssh too, which reads status.json only) shows it while the run trains."""
    while True:
        try:
            return proc.wait(timeout=poll)
        except subprocess.TimeoutExpired:
            if note_compile_start(status):
                write_status(work_root, status)


def settle_bundles(status: RunStatus) -> None:
    """At a run's end: how it started compiling, and the bundle it wrote copied into its
    output folder (a copy that fails is noted, never silent)."""
    note_compile_start(status)
    note = collect_written_bundle(Path(status.output_dir))
    if note:
        status.notes.append(note)


def stop_process(proc: subprocess.Popen, grace: float) -> None:
    """Give the trainer `grace` seconds to stop on its stop file, then terminate, then kill."""
    for action in (None, proc.terminate, proc.kill):
        if action:
            action()
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def finish_run(work_root: Path, status: RunStatus, returncode: int | None, cancelled: bool) -> None:
    """Record how a run ended, in status.json and (when the trainer could not) in run.json."""
    status.exit_code, status.ended_at = returncode, time.time()
    if cancelled:
        status.state, status.error = CANCELLED, "cancelled (tempera-cloud cancel or a cancelled job)"
    elif returncode == 0:
        status.state = FINISHED
    else:
        status.state = FAILED
        status.error = f"{describe_exit(returncode)}; see {status.log}"
    if status.state != FINISHED:
        settle_run_record(Path(status.output_dir), status.state, status.error,
                          status.run_meta())
    settle_bundles(status)
    write_status(work_root, status)


def start_background_worker(work_root: Path, python: str | None = None) -> subprocess.Popen:
    """Start `tempera-cloud work` detached, so the push returns while the queue runs.

    Its stdin/stdout/stderr must not be the hook's: git keeps the push open until every copy of
    the hook's output pipes is closed.
    """
    work_root = Path(work_root)
    work_root.mkdir(parents=True, exist_ok=True)
    with open(work_root / "worker.log", "ab") as log:
        return subprocess.Popen(
            [python or sys.executable, "-m", "modules.cloud.cli", "work", "--work-root",
             str(work_root)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=work_root,
            env=clean_git_env(), start_new_session=True, close_fds=True)


def wait_for(work_root: Path, run_ids: list[str], timeout: float, poll: float = 0.5) -> list[RunStatus]:
    """Poll until every run is finished, failed or invalid; TimeoutError names the ones that are not."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = [read_status(work_root, r) for r in run_ids]
        if all(s.state in DONE_STATES for s in statuses):
            return statuses
        if time.monotonic() > deadline:
            pending = [f"{s.run_id} ({s.state})" for s in statuses if s.state not in DONE_STATES]
            raise TimeoutError(f"runs not done after {timeout:.0f} s: {', '.join(pending)}")
        time.sleep(poll)
