"""Refuse secret-looking values: hub and cloud tokens, private keys, passwords, netrc lines.

Secrets never belong in configs, presets, run records or anything committed: they come from a
secrets file outside the repo or from environment variables the user names (docs/cloud.md).
The same table (`SECRET_PATTERNS`, in modules/util/secrets.py) serves every guard:
`push-and-train`, the training repo's pre-push hook, the GPU machine's pre-receive hook (`modules.cloud.pre_receive`) and the check
of what a run copies into its folders. Findings never echo a value: only where it is, what it
looks like and a masked form (`hf_a…(37 chars)`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from modules.cloud.git import ZERO_SHA, commit_exists, git
# The table itself is below the config and the engine, which use it too (modules/util/secrets.py).
from modules.util.secrets import (  # noqa: F401 - re-exported for the cloud guards and tests
    CREDENTIAL_FILES, KEY_VALUE, NOT_A_SECRET, SECRET_PATTERNS, SecretPattern, applies_to, mask)


@dataclass(frozen=True)
class Finding:
    where: str  # file (and commit), or a commit message
    line: int
    kind: str
    masked: str = ""

    def __str__(self) -> str:
        value = f" [{self.masked}]" if self.masked else ""
        return f"{self.where}:{self.line}: looks like a {self.kind}{value}"


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
            if not NOT_A_SECRET.match(value):
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
