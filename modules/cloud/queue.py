"""The cloud run queue: one folder and status.json per run, one run at a time under a lock.

```
<work-root>/
  queue.lock                 held by the worker while it runs the queue
  worker.log                 the background worker's own output
  checkouts/<sha>/           the pushed commit, exported read-only for its runs
  runs/<run-id>/status.json  queued | running | finished | failed | invalid, with timestamps
  runs/<run-id>/log.txt      tempera-train's output
  outputs/<run-id>/          the run's output.dir (config.json, run.json, weights, samples)
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

from modules.cloud.git import clean_git_env
from modules.util.atomic import atomic_write_text

QUEUED, RUNNING, FINISHED, FAILED, INVALID = "queued", "running", "finished", "failed", "invalid"
DONE_STATES = (FINISHED, FAILED, INVALID)


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

    @classmethod
    def from_dict(cls, data: dict) -> RunStatus:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def runs_dir(work_root: Path) -> Path:
    return Path(work_root) / "runs"


def status_path(work_root: Path, run_id: str) -> Path:
    return runs_dir(work_root) / run_id / "status.json"


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
def queue_lock(work_root: Path, blocking: bool) -> Iterator[bool]:
    """Hold `<work-root>/queue.lock`; yields False at once when another worker holds it."""
    path = Path(work_root) / "queue.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def next_queued(work_root: Path) -> RunStatus | None:
    return next((s for s in list_statuses(work_root) if s.state == QUEUED), None)


def process_queue(work_root: Path, wait_for_lock: bool = False) -> list[str]:
    """Run queued runs one at a time, oldest first, until none is left; return the ids run.

    Without wait_for_lock, returns at once when another worker holds the lock: that worker
    looks for queued runs again after it releases the lock, so a run queued meanwhile is not
    left behind.
    """
    done: list[str] = []
    while True:
        with queue_lock(work_root, blocking=wait_for_lock) as held:
            if not held:
                return done
            while (status := next_queued(work_root)) is not None:
                execute_run(work_root, status)
                done.append(status.run_id)
        if next_queued(work_root) is None:
            return done


def execute_run(work_root: Path, status: RunStatus) -> RunStatus:
    """Run one queued run's command with its log file; record running, then finished/failed."""
    status.state, status.started_at, status.worker_pid = RUNNING, time.time(), os.getpid()
    write_status(work_root, status)
    log = Path(status.log)
    try:
        with open(log, "ab") as handle:
            proc = subprocess.run(status.command, stdin=subprocess.DEVNULL, stdout=handle,
                                  stderr=subprocess.STDOUT, cwd=log.parent, env=clean_git_env())
        status.exit_code = proc.returncode
        status.state = FINISHED if proc.returncode == 0 else FAILED
        if proc.returncode:
            status.error = f"tempera-train exited with {proc.returncode}; see {log}"
    except OSError as exc:  # the command could not start (moved interpreter, bad --tempera)
        status.state, status.error = FAILED, f"could not start {status.command[:1]}: {exc}"
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(f"tempera-cloud: {status.error}\n")
    status.ended_at = time.time()
    write_status(work_root, status)
    return status


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
