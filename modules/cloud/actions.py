"""`tempera-cloud run-changed`: the GitHub Actions path (templates/cloud/github-actions.yml).

Which configs to train is decided against what this runner has trained, by content: the runner
keeps `<work-root>/trained-configs.json` (`{key: {config path: blob id}}`, key: the repository),
so a force push or a fresh checkout does not retrain unchanged configs. The push's `before` is
used only the first time, when the runner has no record for the repository (then the configs
already there at `before` are recorded as handled). A cancelled job
(SIGINT/SIGTERM from the runner) stops the training, records its runs `cancelled` and exits 130.
"""
from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

from modules.cloud.git import ZERO_SHA, commit_exists
from modules.cloud.queue import (CANCELLED, DONE_STATES, FINISHED, INVALID, process_queue,
                                 read_status, write_status)
from modules.cloud.runs import (CloudSettings, changed_configs, config_blobs, describe,
                                queue_changed_runs, repo_git_dir, untrained_configs)
from modules.util.atomic import atomic_write_text

TRAINED_RECORD = "trained-configs.json"


def load_trained(work_root: Path, key: str) -> dict[str, str] | None:
    path = Path(work_root) / TRAINED_RECORD
    if not path.is_file():
        return None
    return json.loads(path.read_text("utf-8")).get(key)


def save_trained(work_root: Path, key: str, blobs: dict[str, str]) -> None:
    path = Path(work_root) / TRAINED_RECORD
    data = json.loads(path.read_text("utf-8")) if path.is_file() else {}
    data[key] = {**data.get(key, {}), **blobs}
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_changed(repo: Path, before: str | None, after: str, settings: CloudSettings, key: str,
                copy_logs: Path | None = None, say: Callable[[str], None] = print) -> int:
    """Queue what this runner has not trained, run the queue, report; the job's exit code."""
    git_dir = repo_git_dir(repo)
    work_root = Path(settings.work_root)
    trained = load_trained(work_root, key)
    if trained is None and before:
        configs = changed_configs(git_dir, before, after, settings.runs_dir)
        if before != ZERO_SHA and commit_exists(before, git_dir=git_dir):
            # The runner's first job: configs already there before this push count as handled,
            # or the next job would train every config this runner never saw.
            save_trained(work_root, key, config_blobs(git_dir, before, settings.runs_dir))
    else:
        configs = untrained_configs(git_dir, after, trained or {}, settings.runs_dir)
    statuses = queue_changed_runs(git_dir, before or "", after, settings, configs=configs)
    for status in statuses:
        say(describe(status))
    if not statuses:
        say("tempera-cloud: no config under runs/ differs from what this runner trained; "
            "nothing to train")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        process_queue(work_root, wait_for_lock=True)
        cancelled = False
    except KeyboardInterrupt:
        cancelled = True
    finally:
        signal.signal(signal.SIGTERM, previous)
    ended = [read_status(work_root, s.run_id) for s in statuses]
    for status in ended:
        if cancelled and status.state not in DONE_STATES:
            status.state, status.error = CANCELLED, "the job was cancelled before it ran"
            write_status(work_root, status)
        say(f"tempera-cloud: {status.run_id}: {status.state} {status.error}".rstrip())
        if copy_logs and Path(status.log).is_file():
            Path(copy_logs).mkdir(parents=True, exist_ok=True)
            shutil.copy2(status.log, Path(copy_logs) / f"{status.run_id}.log")
    blobs = config_blobs(git_dir, after, settings.runs_dir)
    save_trained(work_root, key, {s.config: blobs[s.config] for s in ended
                                  if s.state in (FINISHED, INVALID) and s.config in blobs})
    if cancelled:
        return 130
    return 1 if any(s.state != FINISHED for s in ended) else 0
