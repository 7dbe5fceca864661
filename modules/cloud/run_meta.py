"""`tempera-train --run-meta key=value`: facts about where a run came from, kept in run.json.

Cloud runs record the commit they trained (`commit=<sha>`), the config's path in the training
repo and the cloud run id under `"meta"` in run.json, so a result can be traced to its source.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from modules.cloud.secrets import scan_text
from modules.config import ConfigError, Problem
from modules.util.atomic import atomic_write_text

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def parse_run_meta(pairs: list[str]) -> dict[str, str]:
    """`["commit=abc", ...]` as a dict; malformed pairs and secret-looking values are refused."""
    meta, problems = {}, []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not _KEY.match(key):
            problems.append(Problem("--run-meta", "key=value with a plain key", repr(pair)))
        elif scan_text(pair, "--run-meta"):
            problems.append(Problem(f"--run-meta {key}", "a value that is not a secret",
                                    "a secret-looking value", "run records must not hold secrets"))
        else:
            meta[key] = value
    if problems:
        raise ConfigError(problems, "--run-meta")
    return meta


def add_run_meta(run_json: Path, meta: dict[str, str]) -> None:
    """Merge `meta` into the `"meta"` object of an existing run.json (atomically)."""
    if not meta or not Path(run_json).is_file():
        return
    record = json.loads(Path(run_json).read_text(encoding="utf-8"))
    record["meta"] = {**record.get("meta", {}), **meta}
    atomic_write_text(Path(run_json), json.dumps(record, indent=2) + "\n")
