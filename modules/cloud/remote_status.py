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

from modules.cloud.git import CloudError
from modules.cloud.queue import RunStatus, list_statuses

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


def format_table(statuses: list[RunStatus]) -> str:
    if not statuses:
        return "no runs yet"
    rows = [("RUN", "STATE", "COMMIT", "CONFIG", "EXIT", "NOTE")]
    for s in statuses:
        note = s.error or (s.output_dir if s.state in ("finished", "running") else "")
        rows.append((s.run_id, s.state, s.commit[:10], s.config,
                     "" if s.exit_code is None else str(s.exit_code), note))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5]
                     for r in rows).rstrip()
