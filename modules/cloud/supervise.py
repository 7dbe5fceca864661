"""Who is still training: process identity, dead runs, the run's own record, restarts.

A run's status records the training process as (pid, boot id, process start time): a pid alone
is reused after a reboot or a long uptime, the boot id (`/proc/sys/kernel/random/boot_id`)
changes at every boot, and the start time tells a reused pid on the same boot. A `running` run
whose process is gone was interrupted (the worker was killed, the machine rebooted): every
worker start reconciles it (`reconcile`), and `status` shows it as interrupted.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

from modules.util.atomic import atomic_write_text

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot's id on Linux; empty where there is none (macOS), then only the pid counts."""
    try:
        return BOOT_ID_FILE.read_text().strip()
    except OSError:
        return ""


def parse_proc_start(stat_line: str) -> str:
    """Field 22 (starttime, in clock ticks since boot) of a /proc/<pid>/stat line.

    The second field is the command name in parentheses and may hold spaces, so the fields are
    counted after the last ')'. A zombie (state Z or X: ended, not yet reaped, as happens under a
    container's init) counts as gone: ''.
    """
    fields = stat_line.rpartition(")")[2].split()
    if len(fields) <= 19 or fields[0] in ("Z", "X"):
        return ""
    return fields[19]


def process_start(pid: int) -> str:
    """The start time of a live process ('' when it is gone or /proc does not exist)."""
    try:
        return parse_proc_start(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return ""


def identity(pid: int) -> dict:
    """What a status records about a training process so a later check can tell it is the same."""
    return {"train_pid": pid, "boot_id": boot_id(), "proc_start": process_start(pid)}


def is_alive(pid: int | None, recorded_boot: str, recorded_start: str,
             current_boot: str, current_start: str | None) -> bool:
    """Whether the recorded process still runs, from the facts read on its machine.

    `current_start` is the start time now found for that pid ('' when gone), or None where
    /proc does not exist (then the pid's existence decides, checked by the caller).
    """
    if not pid:
        return False
    if recorded_boot and current_boot and recorded_boot != current_boot:
        return False  # the machine rebooted since
    if current_start is None:
        return True
    return bool(current_start) and (not recorded_start or current_start == recorded_start)


def local_is_alive(pid: int | None, recorded_boot: str, recorded_start: str) -> bool:
    """`is_alive` for a process of this machine."""
    if not pid:
        return False
    if Path("/proc").is_dir():
        return is_alive(pid, recorded_boot, recorded_start, boot_id(), process_start(pid))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_exit(returncode: int | None) -> str:
    if returncode is None:  # the process was not reaped (finish_run allows it)
        return "tempera-train's exit status is unknown"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"tempera-train was killed by {name}"
    return f"tempera-train exited with {returncode}"


def settle_run_record(output_dir: Path, status: str, error: str,
                      meta: dict[str, str] | None = None) -> bool:
    """Make run.json agree when the trainer could not write its own end (killed, cancelled).

    A record still saying `running` is changed. A missing one is written: a trainer killed
    before it wrote its first record (a slow start, a busy machine) still leaves one that says
    how it ended, carrying the cloud run's `meta` as the trainer's `--run-meta` would have.
    A record that says anything else is the trainer's own word and stays. Returns whether
    run.json was written.
    """
    path = Path(output_dir) / "run.json"
    ended = {"status": status, "error": error, "ended_by": "tempera-cloud worker",
             "ended_at": time.time()}
    if not path.exists():
        record = {**ended, "meta": dict(meta or {}),
                  "note": "the training process ended before it wrote run.json; "
                          "this record was written by the tempera-cloud worker"}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(record, indent=2) + "\n")
        return True
    try:
        record = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return False
    if record.get("status") != "running":
        return False
    record.update(ended)
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")
    return True


# How many times a run whose process died is started again before it is left `failed`.
MAX_RESTARTS = 3


def restart_command(status, work_root: Path) -> list[str]:
    """How an interrupted run starts again; the one place that decides it.

    When the interrupted attempt wrote a backup (docs/resume.md), the run resumes from the
    newest one in place (`--resume`), exactly where it stopped. Without one (killed before its
    first backup), it starts again from scratch, the attempt's output folder kept aside as
    `outputs/<run-id>.attempt-<n>`.
    """
    from modules.frontend import list_backups
    output = Path(status.output_dir)
    found = list_backups(output)
    if found:
        step, folder = found[-1]
        status.notes.append(f"restart {status.restarts + 1}: resumed from {folder.name} "
                            f"(step {step})")
        return [*status.command, "--resume"]
    if output.exists():
        kept = output.with_name(f"{output.name}.attempt-{status.restarts}")
        shutil.move(str(output), str(kept))
        status.notes.append(f"restart {status.restarts + 1}: no backup yet, started again; "
                            f"attempt {status.restarts}'s output kept in {kept}")
    return list(status.command)
