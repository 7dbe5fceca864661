"""Secret-looking values: the one table of patterns (hub and cloud tokens, private keys,
passwords, netrc lines), scanning text for them, and masking them.

It lives here, below the config and the engine, because three layers use it: the cloud guards
refuse to push a secret (modules/cloud/secrets.py), validation warns about one in a run's
settings, and the run's records (config.json, run.json, backups, weights' metadata) mask it.
Findings and masks never echo a value: only what it looks like and a masked form
(`hf_…(37 chars)`).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

# File names where a bare 40-hex value or a netrc `login`/`password` word pair is a credential
# (a WandB API key is 40 hex digits; ~/.netrc holds `machine api.wandb.ai login user password
# KEY`). Elsewhere 40 hex digits are usually a commit sha and are not refused.
CREDENTIAL_FILES = ("*netrc*", "*wandb*", ".env", ".env.*", "*.env", "*secret*", "*credential*")


@dataclass(frozen=True)
class SecretPattern:
    """One row: what it is, the regex (its `value` group, else the whole match, is the secret),
    and the file names it applies to (None: every file, commit messages too)."""
    kind: str
    regex: re.Pattern
    files: tuple[str, ...] | None = None


SECRET_PATTERNS: list[SecretPattern] = [
    SecretPattern("Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")),
    SecretPattern("GitHub token",
                  re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{40,})\b")),
    SecretPattern("GitLab token", re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}\b")),
    SecretPattern("private key", re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")),
    SecretPattern("AWS access key id", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b")),
    SecretPattern("Google API key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}\b")),
    SecretPattern("OpenAI-style API key", re.compile(r"\bsk-(?:proj-)?[A-Za-z0-9_-]{32,}\b")),
    SecretPattern("Stripe key", re.compile(r"\b[sr]k_live_[A-Za-z0-9]{20,}\b")),
    SecretPattern("Slack token", re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b")),
    SecretPattern("Azure storage key", re.compile(r"AccountKey=(?P<value>[A-Za-z0-9+/=]{40,})")),
    SecretPattern("netrc password",
                  re.compile(r"\bmachine\s+\S+\s+(?:login\s+\S+\s+)?password\s+(?P<value>\S+)")),
    SecretPattern("netrc password", re.compile(r"^\s*password\s+(?P<value>\S+)"), CREDENTIAL_FILES),
    SecretPattern("netrc login", re.compile(r"^\s*(?:machine\s+\S+\s+)?login\s+(?P<value>\S+)"),
                  CREDENTIAL_FILES),
    SecretPattern("40-hex API key (WandB style)",
                  re.compile(r"(?<![0-9a-fA-F])(?P<value>[0-9a-f]{40})(?![0-9a-fA-F])"),
                  CREDENTIAL_FILES),
    # In any file (a config, a preset, a commit): 40 hex digits as the value of a key that names
    # W&B (`WANDB_API_KEY=…`, `"wandb_project": "…"`); a bare commit sha elsewhere is not one.
    SecretPattern("WandB API key",
                  re.compile(r"wandb[A-Za-z0-9_.-]*[\"']?\s*[:=]\s*[\"']?"
                             r"(?P<value>[0-9a-f]{40})(?![0-9a-fA-F])", re.IGNORECASE)),
]

# A key whose name ends in one of these words, followed by `:` or `=` and a value:
# `"hub_token": "abc"`, `password=abc`, `aws_secret_access_key: abc`. `tokenizer` does not match.
_KEY_WORDS = r"(?:password|passwd|passphrase|secret|token|api[_-]?key|access[_-]?key|private[_-]?key)"
KEY_VALUE = re.compile(
    r"(?<![A-Za-z0-9_.-])[\"']?(?P<key>[A-Za-z0-9_.-]*" + _KEY_WORDS + r")[\"']?\s*[:=]\s*"
    r"(?P<value>\"[^\"]*\"|'[^']*'|<[^>]*>|[^\s,#}\]]+)", re.IGNORECASE)

# A name that says its value is a secret (`wandb_api_key`, `hub_token`, `password`).
SECRET_NAME = re.compile(_KEY_WORDS + r"$", re.IGNORECASE)

# Values that name where a secret comes from instead of holding it.
NOT_A_SECRET = re.compile(r"^(?:|null|none|true|false|[-+]?\d+(?:\.\d+)?|\$\{?[A-Za-z_][A-Za-z0-9_]*\}?"
                           r"|env:[A-Za-z_][A-Za-z0-9_]*|<[^>]*>|\*+|\.\.\.)$", re.IGNORECASE)


def mask(value: str) -> str:
    """Enough of a value to recognise which one it is, never enough to use it."""
    value = value.strip("\"'")
    shown = value[:3] if len(value) >= 12 else ""
    return f"{shown}…({len(value)} chars)"


def applies_to(pattern: SecretPattern, file_name: str | None) -> bool:
    """Whether a row applies to a file (by its base name); rows for every file apply to all."""
    if pattern.files is None:
        return True
    if not file_name:
        return False
    base = PurePosixPath(file_name).name.lower()
    return any(fnmatch.fnmatch(base, glob) for glob in pattern.files)


def find_secrets(text: str) -> list[tuple[str, str]]:
    """(kind, masked value) of every secret-looking value in a setting's text: the rows that
    apply to any text (not the credential-file-only ones) and `key: value` pairs."""
    found = []
    for row in SECRET_PATTERNS:
        if row.files is None:
            for match in row.regex.finditer(text):
                value = match.group("value") if "value" in row.regex.groupindex else match.group(0)
                found.append((row.kind, mask(value)))
    for match in KEY_VALUE.finditer(text):
        value = match.group("value").strip("\"'").strip()
        if not NOT_A_SECRET.match(value):
            found.append((f"secret value for key '{match.group('key')}'", mask(value)))
    return found


def mask_secrets(text: str) -> str:
    """`text` with every secret-looking value (as `find_secrets` sees them) replaced by
    `[masked <kind>]`; everything else is kept as it was."""
    for row in SECRET_PATTERNS:
        if row.files is None:
            text = row.regex.sub(lambda m: _masked(m, row.kind), text)  # called right here

    def key_value(match: re.Match) -> str:
        value = match.group("value").strip("\"'").strip()
        if NOT_A_SECRET.match(value):
            return match.group(0)
        return _masked(match, "secret")
    return KEY_VALUE.sub(key_value, text)


def _masked(match: re.Match, kind: str) -> str:
    """The match with its `value` group (else all of it) replaced by `[masked <kind>]`."""
    group = "value" if "value" in match.re.groupindex else 0
    start, end = match.start(group) - match.start(0), match.end(group) - match.start(0)
    return match.group(0)[:start] + f"[masked {kind}]" + match.group(0)[end:]


def mask_tree(value: Any) -> Any:
    """A copy of a JSON-like tree (dicts, lists, strings, numbers) with `mask_secrets` applied
    to every string value: what a record may hold."""
    if isinstance(value, str):
        return mask_secrets(value)
    if isinstance(value, dict):
        return {k: mask_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_tree(v) for v in value]
    return value


def tree_secrets(value: Any, path: str = "") -> list[tuple[str, str, str]]:
    """(dotted path, kind, masked value) of every secret-looking string in a JSON-like tree
    (list items as `path[i]`)."""
    if isinstance(value, str):
        return [(path, kind, masked) for kind, masked in find_secrets(value)]
    if isinstance(value, dict):
        return [f for k, v in value.items() for f in tree_secrets(v, f"{path}.{k}" if path else k)]
    if isinstance(value, (list, tuple)):
        return [f for i, v in enumerate(value) for f in tree_secrets(v, f"{path}[{i}]")]
    return []
