"""Child processes started in their own session: killing them whole, and why they ended."""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
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


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def dies_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that asks Linux to SIGKILL the child when the process that started it
    dies, even by SIGKILL, which no cleanup of the parent can catch (None elsewhere: then only
    the parent's own cleanup kills its children). A child in its own session is otherwise left
    running when its parent is killed, holding a GPU that a rerun then finds busy."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not in the child
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)
    return arm


def last_log_line(log: Path, limit: int = 400) -> str:
    """The last non-empty line of a child's log: usually the error it died with."""
    try:
        lines = [x.strip() for x in log.read_text("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        return f"no log at {log}"
    return lines[-1][:limit] if lines else "the process exited without output"
