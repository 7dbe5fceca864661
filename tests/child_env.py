"""The environment of a child Python process that a test starts (tempera-train, the worker).

The child must import this checkout's `modules/`, so the repository goes first on PYTHONPATH.
It must also keep every entry PYTHONPATH already had: the GPU machine's image installs
diffusers and friends in a `.site/` folder named only there (../shared/gpu/README.md), so a
child whose PYTHONPATH was replaced by the repository alone cannot import them.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def with_repo_on_pythonpath(env: Mapping[str, str] | None = None,
                            repo: Path = REPO) -> dict[str, str]:
    """A copy of ``env`` (default: this process's environment) with ``repo`` prepended to
    PYTHONPATH, every existing entry kept after it."""
    child = dict(os.environ if env is None else env)
    existing = child.get("PYTHONPATH", "")
    child["PYTHONPATH"] = os.pathsep.join([str(repo), existing]) if existing else str(repo)
    return child
