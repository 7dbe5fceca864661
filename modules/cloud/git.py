"""Running git from the cloud code: explicit repository, clear errors, no inherited repo env."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ZERO_SHA = "0" * 40

# Git exports these to hooks (GIT_DIR=. in a post-receive hook, for one). A git command run
# from the hook against another repository (or a training subprocess that runs git) would
# silently act on the hook's repository, so they are removed and the repo is always passed.
_REPO_LOCATION_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY",
                       "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_QUARANTINE_PATH", "GIT_PREFIX",
                       "GIT_COMMON_DIR", "GIT_NAMESPACE")


class CloudError(Exception):
    """A cloud command could not do what was asked; the message says what and why."""


def clean_git_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment without git's repository-location variables."""
    env = dict(os.environ if env is None else env)
    for name in _REPO_LOCATION_VARS:
        env.pop(name, None)
    return env


_QUARANTINE_VARS = ("GIT_OBJECT_DIRECTORY", "GIT_ALTERNATE_OBJECT_DIRECTORIES",
                    "GIT_QUARANTINE_PATH")


def quarantine_env() -> dict[str, str]:
    """The environment for git commands a pre-receive hook runs on its own repository.

    A pushed commit's objects sit in a quarantine folder until every pre-receive hook accepts
    the push; git tells the hook where through these variables, so they are kept here (and only
    here: they would point any other repository at the wrong objects).
    """
    env = clean_git_env()
    env.update({name: os.environ[name] for name in _QUARANTINE_VARS if name in os.environ})
    return env


def git(args: list[str], cwd: Path | None = None, git_dir: Path | None = None,
        input_bytes: bytes | None = None, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `git [--git-dir D] args` and return the completed process (bytes output).

    A failing command raises CloudError with git's own message unless check is False. The
    environment is `clean_git_env()` unless `env` is given (the pre-receive hook's quarantine).
    """
    command = ["git"] + (["--git-dir", str(git_dir)] if git_dir else []) + list(args)
    proc = subprocess.run(command, cwd=cwd, input=input_bytes, capture_output=True,
                          env=env if env is not None else clean_git_env())
    if check and proc.returncode != 0:
        message = proc.stderr.decode(errors="replace").strip() or proc.stdout.decode(
            errors="replace").strip()
        raise CloudError(f"git {' '.join(args)} failed (exit {proc.returncode}): {message}")
    return proc


def git_text(args: list[str], cwd: Path | None = None, git_dir: Path | None = None) -> str:
    """Run git and return its stdout as text with the trailing newline removed."""
    return git(args, cwd=cwd, git_dir=git_dir).stdout.decode("utf-8", errors="replace").rstrip("\n")


def show_file(git_dir: Path, commit: str, path: str) -> bytes:
    """The content of `path` at `commit`."""
    return git(["show", f"{commit}:{path}"], git_dir=git_dir).stdout


def commit_exists(sha: str, cwd: Path | None = None, git_dir: Path | None = None) -> bool:
    proc = git(["cat-file", "-e", f"{sha}^{{commit}}"], cwd=cwd, git_dir=git_dir, check=False)
    return proc.returncode == 0
