"""Refuse secret-looking values: hub and cloud tokens, private keys, passwords, netrc lines.

Secrets never belong in configs, presets, run records or anything committed: they come from a
secrets file outside the repo or from environment variables the user names (docs/cloud.md).
The same table (`SECRET_PATTERNS`) serves every guard: `push-and-train`, the training repo's
pre-push hook, the GPU machine's pre-receive hook (`modules.cloud.pre_receive`) and the check
of what a run copies into its folders. Findings never echo a value: only where it is, what it
looks like and a masked form (`hf_a…(37 chars)`).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from modules.cloud.git import ZERO_SHA, commit_exists, git

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
]

# A key whose name ends in one of these words, followed by `:` or `=` and a value:
# `"hub_token": "abc"`, `password=abc`, `aws_secret_access_key: abc`. `tokenizer` does not match.
_KEY_WORDS = r"(?:password|passwd|passphrase|secret|token|api[_-]?key|access[_-]?key|private[_-]?key)"
KEY_VALUE = re.compile(
    r"(?<![A-Za-z0-9_.-])[\"']?(?P<key>[A-Za-z0-9_.-]*" + _KEY_WORDS + r")[\"']?\s*[:=]\s*"
    r"(?P<value>\"[^\"]*\"|'[^']*'|<[^>]*>|[^\s,#}\]]+)", re.IGNORECASE)

# Values that name where a secret comes from instead of holding it.
_NOT_A_SECRET = re.compile(r"^(?:|null|none|true|false|[-+]?\d+(?:\.\d+)?|\$\{?[A-Za-z_][A-Za-z0-9_]*\}?"
                           r"|env:[A-Za-z_][A-Za-z0-9_]*|<[^>]*>|\*+|\.\.\.)$", re.IGNORECASE)


def mask(value: str) -> str:
    """Enough of a value to recognise which one it is, never enough to use it."""
    value = value.strip("\"'")
    shown = value[:3] if len(value) >= 12 else ""
    return f"{shown}…({len(value)} chars)"


@dataclass(frozen=True)
class Finding:
    where: str  # file (and commit), or a commit message
    line: int
    kind: str
    masked: str = ""

    def __str__(self) -> str:
        value = f" [{self.masked}]" if self.masked else ""
        return f"{self.where}:{self.line}: looks like a {self.kind}{value}"


def applies_to(pattern: SecretPattern, file_name: str | None) -> bool:
    """Whether a row applies to a file (by its base name); rows for every file apply to all."""
    if pattern.files is None:
        return True
    if not file_name:
        return False
    base = PurePosixPath(file_name).name.lower()
    return any(fnmatch.fnmatch(base, glob) for glob in pattern.files)


def scan_text(text: str, where: str, file_name: str | None = None) -> list[Finding]:
    """Every secret-looking value in `text`, one finding per kind per line.

    `file_name` selects the rows that only apply to credential-like files (netrc, wandb, .env);
    without one, `where` is used when it looks like a path.
    """
    name = file_name if file_name is not None else where.split(" ")[0]
    rows = [p for p in SECRET_PATTERNS if applies_to(p, name)]
    findings = []
    for number, line in enumerate(text.splitlines(), start=1):
        kinds = set()
        for row in rows:
            match = row.regex.search(line)
            if match and row.kind not in kinds:
                kinds.add(row.kind)
                value = match.group("value") if "value" in row.regex.groupindex else match.group(0)
                findings.append(Finding(where, number, row.kind, mask(value)))
        for match in KEY_VALUE.finditer(line):
            value = match.group("value").strip("\"'").strip()
            if not _NOT_A_SECRET.match(value):
                findings.append(Finding(where, number,
                                        f"secret value for key '{match.group('key')}'", mask(value)))
    return findings


def scan_bytes(data: bytes, where: str, file_name: str | None = None) -> list[Finding]:
    """Scan file content; binary content (with a NUL byte) is skipped."""
    if b"\0" in data[:8192]:
        return []
    return scan_text(data.decode("utf-8", errors="replace"), where, file_name)


def scan_files(paths: list[Path]) -> list[Finding]:
    findings = []
    for path in paths:
        findings += scan_bytes(Path(path).read_bytes(), str(path), Path(path).name)
    return findings


def scan_staged(repo: Path) -> list[Finding]:
    """Findings in the staged (index) version of every file added or changed for the next commit."""
    names = git(["diff", "--cached", "--name-only", "-z", "--diff-filter=ACMR"], cwd=repo).stdout
    findings = []
    for name in filter(None, names.decode().split("\0")):
        findings += scan_bytes(git(["show", f":{name}"], cwd=repo).stdout, f"{name} (staged)",
                               name)
    return findings


def scan_commits(repo: Path | None, include: list[str], exclude: list[str],
                 git_dir: Path | None = None, env: dict[str, str] | None = None) -> list[Finding]:
    """Findings in the messages and in every file version added or changed by the commits in
    include --not exclude: exactly what a push of `include` to a remote that has `exclude` sends.

    `git_dir`/`env` serve the pre-receive hook (a bare repository and its quarantine).
    """
    def run(args: list[str]) -> bytes:
        return git(args, cwd=repo, git_dir=git_dir, env=env).stdout

    revs = run(["rev-list"] + include + (["--not"] + exclude if exclude else [])).decode()
    findings = []
    for commit in filter(None, revs.splitlines()):
        message = run(["log", "-1", "--format=%B", commit])
        findings += scan_bytes(message, f"commit message of {commit[:10]}", "")
        names = run(["diff-tree", "-r", "-m", "--root", "--no-commit-id", "--name-only", "-z",
                     "--diff-filter=ACMR", commit])
        for name in sorted(set(filter(None, names.decode().split("\0")))):
            blob = run(["show", f"{commit}:{name}"])
            findings += scan_bytes(blob, f"{name} (commit {commit[:10]})", name)
    return findings


def scan_outgoing(repo: Path, remote: str, ref: str = "HEAD") -> list[Finding]:
    """Findings in the commits of `ref` that `remote` does not have yet (per its tracking refs)."""
    return scan_commits(repo, [ref], [f"--remotes={remote}"])


def scan_pre_push(repo: Path, remote: str, ref_lines: list[str]) -> list[Finding]:
    """The pre-push hook's check: stdin lines are `<local ref> <local sha> <remote ref> <remote sha>`."""
    findings = []
    for line in ref_lines:
        parts = line.split()
        if len(parts) != 4 or parts[1] == ZERO_SHA:  # a deletion sends no content
            continue
        local_sha, remote_sha = parts[1], parts[3]
        known = remote_sha != ZERO_SHA and commit_exists(remote_sha, cwd=repo)
        exclude = [remote_sha] if known else [f"--remotes={remote}"]
        findings += scan_commits(repo, [local_sha], exclude)
    return findings


def format_findings(findings: list[Finding]) -> str:
    lines = "\n".join(f"  - {f}" for f in findings)
    return (f"refusing: {len(findings)} secret-looking value(s):\n{lines}\n"
            "Secrets belong in a secrets file outside the repository or in environment variables "
            "you name, never in configs or anything committed (docs/cloud.md).")
