"""`tempera-cloud status`: read run statuses and log tails, locally or over ssh.

A remote is a local work root path, `ssh://[user@]host[:port]/path`, or `[user@]host:/path`.
Over ssh only `cat` and `tail` run on the machine, with the path quoted for its shell; ssh's
own configuration (~/.ssh/config, agent) supplies keys, nothing here stores them.
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from modules.cloud.bundles import describe_compile_start
from modules.cloud.git import CloudError
from modules.cloud.queue import (FINISHED, INTERRUPTED, RUNNING, RunStatus, cancel_path, list_statuses,
                                 progress_path)
from modules.cloud.supervise import is_alive, local_is_alive, parse_proc_start
from modules.frontend import read_run_status
from modules.util.duration import format_duration

_SCP_LIKE = re.compile(r"^(?P<host>(?:[A-Za-z0-9._-]+@)?[A-Za-z0-9._-]+):(?P<path>.+)$")
_RUN_ID = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class Remote:
    path: str
    host: str | None = None  # None: a local path
    port: int | None = None


def parse_remote(text: str) -> Remote:
    """Tell a local path from an ssh location."""
    if text.startswith("ssh://"):
        url = urlsplit(text)
        if not url.hostname or not url.path:
            raise CloudError(f"{text!r}: expected ssh://[user@]host[:port]/path")
        host = f"{url.username}@{url.hostname}" if url.username else url.hostname
        return Remote(url.path, host, url.port)
    match = _SCP_LIKE.match(text)
    if match and not Path(text).exists():
        return Remote(match.group("path"), match.group("host"))
    return Remote(str(Path(text).expanduser()))


def ssh_command(remote: Remote, shell_command: str) -> list[str]:
    """The ssh argv that runs `shell_command` on the remote (BatchMode: never prompt, fail)."""
    if not remote.host or remote.host.startswith("-"):
        raise CloudError(f"not an ssh host: {remote.host!r}")
    ssh = shutil.which("ssh")
    if ssh is None:
        raise CloudError("ssh was not found on PATH")
    port = ["-p", str(remote.port)] if remote.port else []
    return [ssh, "-o", "BatchMode=yes", *port, remote.host, shell_command]


def list_statuses_command(path: str) -> str:
    """Print every status.json under <path>/runs; fails when <path> does not exist."""
    return (f"cd -- {shlex.quote(path)} && for f in runs/*/status.json; do "
            f'if [ -f "$f" ]; then cat -- "$f"; echo; fi; done')


def log_tail_command(path: str, run_id: str, lines: int) -> str:
    return f"tail -n {int(lines)} -- {shlex.quote(f'{path}/runs/{run_id}/log.txt')}"


def _run_ssh(remote: Remote, command: str) -> str:
    proc = subprocess.run(ssh_command(remote, command), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise CloudError(f"ssh {remote.host} failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def parse_status_stream(text: str) -> list[RunStatus]:
    """Concatenated status.json documents (as `cat` prints them) as RunStatus objects."""
    decoder, statuses, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            break
        data, i = decoder.raw_decode(text, i)
        statuses.append(RunStatus.from_dict(data))
    return sorted(statuses, key=lambda s: (s.queued_at, s.run_id))


def read_statuses(remote: Remote) -> list[RunStatus]:
    if remote.host is None:
        if not Path(remote.path).is_dir():
            raise CloudError(f"{remote.path} is not a folder (expected a tempera-cloud work root)")
        return list_statuses(Path(remote.path))
    return parse_status_stream(_run_ssh(remote, list_statuses_command(remote.path)))


def read_log_tail(remote: Remote, run_id: str, lines: int = 40) -> str:
    if not _RUN_ID.match(run_id):
        raise CloudError(f"{run_id!r} is not a run id")
    if remote.host is None:
        log = Path(remote.path) / "runs" / run_id / "log.txt"
        if not log.is_file():
            raise CloudError(f"no log for run {run_id} at {log}")
        return "".join(log.read_text("utf-8", errors="replace").splitlines(True)[-lines:])
    return _run_ssh(remote, log_tail_command(remote.path, run_id, lines))


@dataclass
class RunView:
    """A run as `status` shows it: its status.json, the state observed now, its progress."""
    status: RunStatus
    state: str  # status.state, or `interrupted` for a `running` run whose process is gone
    progress: dict | None = None
    cancelling: bool = False


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text("utf-8"))
    except (OSError, ValueError):
        return None


def observe_command(path: str, statuses: list[RunStatus]) -> str:
    """One shell command printing the boot id, each training pid's /proc stat line, each run's
    progress.json and whether its cancel marker exists, one line each (parsed by observe)."""
    root = shlex.quote(path)
    lines = ["cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo"]
    for s in statuses:
        pid = int(s.train_pid or 0)
        run = shlex.quote(s.run_id)
        lines.append(f"printf 'pid {pid} '; cat /proc/{pid}/stat 2>/dev/null || echo")
        lines.append(f"printf 'progress %s ' {run}; tr -d '\\n' < {root}/runs/{run}/progress.json"
                     f" 2>/dev/null; echo")
        lines.append(f"printf 'cancel %s ' {run}; test -e {root}/runs/{run}/cancel && echo 1 || echo")
        record = shlex.quote(f"{s.output_dir}/run.json")
        lines.append(f"printf 'record %s ' {run}; grep -o '\"status\": *\"[a-z]*\"' {record} "
                     f"2>/dev/null | head -n 1 | tr -dc 'a-z'; echo")
    return "; ".join(lines)


def parse_observation(text: str) -> tuple[str, dict[int, str], dict[str, dict], set[str],
                                           dict[str, str]]:
    """(boot id, pid -> start time or '', run id -> progress, run ids being cancelled,
    run id -> the status in its run.json)."""
    lines = text.splitlines()
    boot, starts, progress, cancelling = (lines[0].strip() if lines else ""), {}, {}, set()
    records: dict[str, str] = {}
    for line in lines[1:]:
        kind, _, rest = line.partition(" ")
        key, _, value = rest.partition(" ")
        if kind == "pid" and key.isdigit():
            starts[int(key)] = parse_proc_start(value) if value.strip() else ""
        elif kind == "progress" and value.strip():
            try:
                progress[key] = json.loads(value)
            except ValueError:
                pass  # a file being replaced right now; the next read shows it
        elif kind == "cancel" and value.strip():
            cancelling.add(key)
        elif kind == "record":
            records[key] = value.strip().removeprefix("status")
    return boot, starts, progress, cancelling, records


def shown_state(status: RunStatus, alive: bool, record: str) -> str:
    """A `running` run whose process is gone: what its run.json says it ended as (the next
    worker start records it so), else interrupted."""
    if status.state != RUNNING or alive:
        return status.state
    return FINISHED if record in ("finished", "stopped") else INTERRUPTED


def read_views(remote: Remote) -> list[RunView]:
    """Every run with its observed state and progress (what `status` and the GUI show)."""
    statuses = read_statuses(remote)
    active = [s for s in statuses if s.state in (RUNNING, "queued")]
    active_ids = {s.run_id for s in active}
    if remote.host is None:
        root = Path(remote.path)
        return [RunView(s, shown_state(s, local_is_alive(s.train_pid, s.boot_id, s.proc_start),
                                       read_run_status(Path(s.output_dir))),
                        _read_json(progress_path(root, s.run_id)),
                        cancel_path(root, s.run_id).exists())
                if s.run_id in active_ids else RunView(s, s.state) for s in statuses]
    if not active:
        return [RunView(s, s.state) for s in statuses]
    boot, starts, progress, cancelling, records = parse_observation(
        _run_ssh(remote, observe_command(remote.path, active)))
    views = []
    for s in statuses:
        # No boot id: a machine without /proc (macOS); nothing to tell, so it counts as alive.
        start = starts.get(int(s.train_pid or 0), "") if boot else None
        alive = s.state != RUNNING or is_alive(s.train_pid, s.boot_id, s.proc_start, boot, start)
        views.append(RunView(s, shown_state(s, alive, records.get(s.run_id, "")),
                             progress.get(s.run_id),
                             s.run_id in cancelling))
    return views


def progress_cells(view: RunView) -> tuple[str, str, str]:
    """STEP, LOSS and ETA of a running run ('' otherwise)."""
    p = view.progress
    if view.state != RUNNING or not p:
        return "", "", ""
    loss = p.get("loss")
    return (f"{p.get('step', '?')}/{p.get('max_steps', '?')}",
            f"{loss:.4f}" if isinstance(loss, (int, float)) else "",
            format_duration(p.get("eta_seconds")))


def format_table(views: list[RunView]) -> str:
    """The run table: state, commit, config, step/loss/ETA of running runs, exit code, note
    (how the run started compiling: warm from which compile bundle, or cold and why)."""
    if not views:
        return "no runs yet"
    rows = [("RUN", "STATE", "COMMIT", "CONFIG", "STEP", "LOSS", "ETA", "EXIT", "NOTE")]
    for v in views:
        s = v.status
        note = s.error or (s.output_dir if v.state in ("finished", "running") else "")
        if v.state != s.state:
            note = ("its training process is gone; the next worker start "
                    + ("restarts it" if v.state == INTERRUPTED else "records it"))
        elif v.progress and v.progress.get("compile") and v.state == RUNNING:
            note = f"compile: {v.progress['compile']}"
        started = describe_compile_start(s.compile_bundle)  # warm from a bundle, or cold: why
        note = "; ".join(part for part in (started, note) if part)
        state = f"{v.state} (cancelling)" if v.cancelling and v.state in (RUNNING, "queued") \
            else v.state
        rows.append((s.run_id, state, s.commit[:10], s.config, *progress_cells(v),
                     "" if s.exit_code is None else str(s.exit_code), note))
    n = len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(n)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:n], widths)) + "  " + r[n]
                     for r in rows).rstrip()
