"""The Weights & Biases settings (`logging.wandb*`): what is checked before a run starts, so a
missing package, a missing API key or a project name W&B would refuse is reported with the fix
instead of failing after the model is loaded.

The API key is never a config field. wandb reads it from WANDB_API_KEY or from its login
(`wandb login` writes ~/.netrc); a key-looking value or a `wandb_api_key` entry in a config is
refused by the loader (`wandb_key_problems`).
"""
from __future__ import annotations

import importlib.util
import netrc
import os
import re
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from modules.config.outputs import LoggingConfig, WandbMode
from modules.config.problems import Problem

# W&B refuses these characters in a project name, and names over 128 characters.
PROJECT_FORBIDDEN = "/\\#?%:"
PROJECT_MAX = 128
# A W&B API key is 40 hex digits. Only a whole value of that shape is refused: a path into
# the Hugging Face cache holds 40-hex commit hashes (`snapshots/<sha>/`) and is no key.
API_KEY = re.compile(r"[0-9a-f]{40}")
KEY_NAME = re.compile(r"wandb.*(?:api[_-]?key|token)", re.IGNORECASE)
OFFER_OFFLINE = ("or set logging.wandb_mode = OFFLINE to write the run under <output>/wandb "
                 "and upload it later with `wandb sync`")


def has_api_key(environ: Mapping[str, str]) -> bool:
    """Whether wandb will find an API key: WANDB_API_KEY, or its login in the netrc file for
    the W&B host (WANDB_BASE_URL's, api.wandb.ai by default)."""
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    path = Path(environ.get("NETRC", "") or Path.home() / ".netrc")
    if not path.is_file():
        return False
    try:
        return netrc.netrc(str(path)).authenticators(host) is not None
    except (netrc.NetrcParseError, OSError):
        return False


def check_wandb(logging: LoggingConfig, environ: Mapping[str, str] | None = None) -> list[Problem]:
    """Every problem with the W&B settings (none when `logging.wandb` is off): the package, the
    project name, and (ONLINE) an API key."""
    if not logging.wandb:
        return []
    environ = os.environ if environ is None else environ
    problems = []
    if importlib.util.find_spec("wandb") is None:
        problems.append(Problem("logging.wandb", "false (the wandb package is not installed)",
                                "true", "install it with `pip install tempera[wandb]` or "
                                        "`pip install wandb`, or turn W&B logging off"))
    project = logging.wandb_project
    bad = sorted({c for c in project if c in PROJECT_FORBIDDEN})
    if not project.strip() or bad or len(project) > PROJECT_MAX:
        why = ("it is empty" if not project.strip() else
               f"it holds {' '.join(repr(c) for c in bad)}" if bad else
               f"it is {len(project)} characters long")
        problems.append(Problem("logging.wandb_project",
                                f"a W&B project name of 1 to {PROJECT_MAX} characters without "
                                f"{' '.join(PROJECT_FORBIDDEN)}", repr(project),
                                f"W&B refuses it: {why}"))
    if logging.wandb_mode == WandbMode.ONLINE and not has_api_key(environ):
        problems.append(Problem("logging.wandb_mode", "OFFLINE, or ONLINE with a W&B API key",
                                "ONLINE without an API key",
                                "set WANDB_API_KEY in the environment or run `wandb login` "
                                f"(the key is never a config setting), {OFFER_OFFLINE}"))
    return problems


def wandb_key_problems(tree: object, path: str = "",
                       environ: Mapping[str, str] | None = None) -> list[Problem]:
    """A W&B API key in a config or preset (a `wandb_api_key`-like entry, a value shaped like a
    key, or the environment's WANDB_API_KEY anywhere in a value): refused, naming where, never
    echoing the value."""
    environ = os.environ if environ is None else environ
    live_key = environ.get("WANDB_API_KEY", "").strip()
    fix = ("the W&B API key is never a config setting: remove it, and set WANDB_API_KEY in the "
           "environment or run `wandb login`")
    if isinstance(tree, dict):
        found = []
        for key, value in tree.items():
            where = f"{path}.{key}" if path else str(key)
            if KEY_NAME.search(str(key)) and value not in (None, ""):
                found.append(Problem(where, "no W&B API key in a config", "a key entry", fix))
            else:
                found += wandb_key_problems(value, where, environ)
        return found
    if isinstance(tree, list):
        return [p for i, v in enumerate(tree)
                for p in wandb_key_problems(v, f"{path}[{i}]", environ)]
    if isinstance(tree, str) and (API_KEY.fullmatch(tree.strip())
                                  or (len(live_key) >= 20 and live_key in tree)):
        return [Problem(path, "no W&B API key in a config", "a value shaped like a W&B API key "
                        "(40 hex digits) or equal to WANDB_API_KEY", fix)]
    return []
