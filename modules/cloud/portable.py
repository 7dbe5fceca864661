"""Is a config portable: does it run unchanged in a fresh clone of its training repo?

Paths in a config are relative to the config file; a clone on another machine has only what is
inside the repository. Absolute paths and paths that leave the repository are machine-specific
and belong in the machine's local overrides file (`local.json`), not in the committed config.
"""
from __future__ import annotations

from pathlib import Path

from modules.config import Problem, from_dict
from modules.config.loader import path_fields, read_json
from modules.config.schema import BUILTIN_PREFIX

# Cloud runs always write to their own output folder, so output.dir need not be portable.
NOT_CHECKED = ("output.dir",)


def portability_problems(config_file: Path, repo_root: Path) -> list[Problem]:
    """Every path field of the (unresolved) file that would not resolve inside a clone."""
    config_file = Path(config_file)
    raw = from_dict(read_json(config_file), source=str(config_file))  # paths as written
    base, root = config_file.resolve().parent, Path(repo_root).resolve()
    problems = []
    for owner, name, dotted in path_fields(raw):
        value = getattr(owner, name)
        if dotted in NOT_CHECKED or not value or value.startswith(BUILTIN_PREFIX):
            continue
        if value.startswith("~") or Path(value).is_absolute():
            problems.append(Problem(dotted, "a path relative to the config file", repr(value),
                                    "machine-specific: put it in the machine's local.json"))
        elif not (base / value).resolve().is_relative_to(root):
            problems.append(Problem(dotted, "a path inside the training repository", repr(value),
                                    "a clone will not have it: put it in the machine's local.json"))
    return problems
