"""Child processes started in their own session: killing them whole, and why they ended."""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def with_repo_on_pythonpath(env: Mapping[str, str] | None = None,
                            repo: Path = REPO) -> dict[str, str]:
    """A copy of ``env`` (default: this process's environment) with ``repo`` prepended to
    PYTHONPATH and every existing entry kept after it: a child must import this checkout's
    `modules/`, and also what PYTHONPATH already named (the GPU machine's image keeps diffusers
    in a `.site/` folder named only there: ../shared/gpu/README.md)."""
    child = dict(os.environ if env is None else env)
    existing = child.get("PYTHONPATH", "")
    child["PYTHONPATH"] = os.pathsep.join([str(repo), existing]) if existing else str(repo)
    return child


def kill_group(process: subprocess.Popen) -> None:
    """Kill ``process`` and everything it started (inductor's compile workers too): it must
    have been started with ``start_new_session=True``, so its group is its own."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def last_log_line(log: Path, limit: int = 400) -> str:
    """The last non-empty line of a child's log: usually the error it died with."""
    try:
        lines = [x.strip() for x in log.read_text("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        return f"no log at {log}"
    return lines[-1][:limit] if lines else "the process exited without output"
