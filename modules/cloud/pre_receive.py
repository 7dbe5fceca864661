"""The GPU machine's `pre-receive` hook: refuse a push that carries a secret, whoever sent it.

The training repo's pre-push hook only guards pushes from a clone where `tempera-cloud init`
ran (git hooks are not cloned, and `git push --no-verify` skips them). This hook runs on the
receiving bare repository before any ref moves: it scans the blobs and commit messages the push
adds (`rev-list NEW --not --all`) with the same table as every other guard and rejects the whole
push, naming file, line and kind with the value masked. Installed by `tempera-cloud install-hook`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from modules.cloud.git import ZERO_SHA, CloudError, quarantine_env
from modules.cloud.secrets import Finding, scan_commits

PRE_RECEIVE_MARKER = "tempera-cloud pre-receive hook"


def scan_push(git_dir: Path, ref_lines: list[str]) -> list[Finding]:
    """Findings in what the push adds: stdin lines are `<old sha> <new sha> <ref>`."""
    findings: list[Finding] = []
    for line in ref_lines:
        parts = line.split()
        if len(parts) != 3 or parts[1] == ZERO_SHA:  # a deletion adds nothing
            continue
        # `--not --all`: the refs are not updated yet, so this is every commit the repository
        # did not have before the push, for a new branch and a force push alike.
        findings += scan_commits(None, [parts[1]], ["--all"], git_dir=git_dir,
                                 env=quarantine_env())
    return findings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tempera-cloud-pre-receive",
                                     description="pre-receive hook: refuse pushed secrets")
    parser.add_argument("--git-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        findings = scan_push(args.git_dir.resolve(), sys.stdin.read().splitlines())
    except CloudError as exc:
        # Unable to scan means unable to promise: refuse rather than let an unscanned push in.
        print(f"tempera-cloud: push refused, the secrets scan failed: {exc}", file=sys.stderr)
        return 1
    if findings:
        print(f"tempera-cloud: push refused: {len(findings)} secret-looking value(s):",
              file=sys.stderr)
        for finding in findings:
            print(f"tempera-cloud:   - {finding}", file=sys.stderr)
        print("tempera-cloud: remove them from the history (and revoke them); secrets belong in "
              "a secrets file or environment variables, never in commits (docs/cloud.md)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
