"""Refuse to commit or push secret-looking values (hub tokens, private keys, passwords, AWS keys).

Secrets never belong in configs, presets, run records or anything committed: they come from a
secrets file outside the repo or from environment variables the user names (docs/cloud.md).
This scan is the guard `push-and-train` and the training repo's pre-push hook run. Findings
never echo the value itself, only where it is and what it looks like.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from modules.cloud.git import ZERO_SHA, commit_exists, git, git_text

# (kind, pattern) rows; a match anywhere in a line is a finding.
VALUE_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")),
    ("GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{40,})\b")),
    ("private key", re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")),
    ("AWS access key id", re.compile(r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b")),
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


@dataclass(frozen=True)
class Finding:
    where: str  # file (and commit) the value is in
    line: int
    kind: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: looks like a {self.kind}"


def scan_text(text: str, where: str) -> list[Finding]:
    """Every secret-looking value in `text`, one finding per kind per line."""
    findings = []
    for number, line in enumerate(text.splitlines(), start=1):
        for kind, pattern in VALUE_PATTERNS:
            if pattern.search(line):
                findings.append(Finding(where, number, kind))
        for match in KEY_VALUE.finditer(line):
            value = match.group("value").strip("\"'").strip()
            if not _NOT_A_SECRET.match(value):
                findings.append(Finding(where, number,
                                        f"secret value for key '{match.group('key')}'"))
    return findings


def scan_bytes(data: bytes, where: str) -> list[Finding]:
    """Scan file content; binary content (with a NUL byte) is skipped."""
    if b"\0" in data[:8192]:
        return []
    return scan_text(data.decode("utf-8", errors="replace"), where)


def scan_files(paths: list[Path]) -> list[Finding]:
    findings = []
    for path in paths:
        findings += scan_bytes(Path(path).read_bytes(), str(path))
    return findings


def scan_staged(repo: Path) -> list[Finding]:
    """Findings in the staged (index) version of every file added or changed for the next commit."""
    names = git(["diff", "--cached", "--name-only", "-z", "--diff-filter=ACMR"], cwd=repo).stdout
    findings = []
    for name in filter(None, names.decode().split("\0")):
        findings += scan_bytes(git(["show", f":{name}"], cwd=repo).stdout, f"{name} (staged)")
    return findings


def scan_commits(repo: Path, include: list[str], exclude: list[str]) -> list[Finding]:
    """Findings in every file version added or changed by the commits in include --not exclude.

    This is exactly what a push of `include` to a remote that already has `exclude` sends.
    """
    revs = git_text(["rev-list"] + include + (["--not"] + exclude if exclude else []), cwd=repo)
    findings = []
    for commit in filter(None, revs.splitlines()):
        names = git(["diff-tree", "-r", "-m", "--root", "--no-commit-id", "--name-only", "-z",
                     "--diff-filter=ACMR", commit], cwd=repo).stdout
        for name in sorted(set(filter(None, names.decode().split("\0")))):
            blob = git(["show", f"{commit}:{name}"], cwd=repo).stdout
            findings += scan_bytes(blob, f"{name} (commit {commit[:10]})")
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
