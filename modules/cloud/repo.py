"""The user's side: a training repository (`init`) and `push-and-train`.

A training repository holds configs under `runs/`; outputs, caches, secrets files and the
machine's `local.json` are ignored. Its pre-push hook and `push-and-train` refuse secrets.
"""
from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from modules.cloud.bundles import REPO_BUNDLES
from modules.cloud.git import CloudError, git, git_text
from modules.cloud.hook import TEMPLATES, render_template, write_hook
from modules.cloud.portable import portability_problems
from modules.cloud.secrets import format_findings, scan_files, scan_outgoing
from modules.config import Config, ConfigError, from_dict, relativize_paths, save_config, validate
from modules.config.loader import read_json
from modules.config.schema import OutputConfig
from modules.util.atomic import atomic_write_bytes

RUNS_DIR = "runs"
PRE_PUSH_MARKER = "tempera-cloud pre-push hook"
# validate() problems that depend on the machine checking, not on the config: the GPU box
# decides these (its local.json, its GPU, its packages); locally they are only warnings.
MACHINE_DEPENDENT = ("general.device", "training.optimizer")


def init_training_repo(folder: Path, python: str | None = None) -> list[str]:
    """Make `folder` a training repo (git init, runs/, bundles/, .gitignore, README, pre-push
    hook).

    Existing files are kept. Returns what was done, one line each.
    """
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    done = []
    if not (folder / ".git").exists():
        git(["init", "-q", "-b", "main"], cwd=folder)
        done.append(f"git init {folder} (branch main)")
    created = []
    for source, name in (("gitignore", ".gitignore"), ("README.md", "README.md")):
        if not (folder / name).exists():
            shutil.copyfile(TEMPLATES / source, folder / name)
            created.append(name)
    for sub in (RUNS_DIR, REPO_BUNDLES):  # bundles/: compile bundles a push carries
        (folder / sub).mkdir(exist_ok=True)
        if not any((folder / sub).iterdir()):
            (folder / sub / ".gitkeep").touch()
            created.append(f"{sub}/.gitkeep")
    hooks_dir = Path(git_text(["rev-parse", "--git-path", "hooks"], cwd=folder))
    hooks_dir = hooks_dir if hooks_dir.is_absolute() else folder / hooks_dir
    write_hook(hooks_dir / "pre-push", render_template("pre-push", python or sys.executable),
               PRE_PUSH_MARKER, force=False)
    done.append("pre-push hook that refuses secrets")
    if created:
        git(["add", "--"] + created, cwd=folder)
        git(["commit", "-q", "-m", "Training repo (tempera-cloud init)", "--"] + created,
            cwd=folder)
        done.append("committed " + ", ".join(created))
    return done


@dataclass
class PushResult:
    config: str  # path inside the repo
    commit: str
    warnings: list[str] = field(default_factory=list)
    push_output: str = ""

    @property
    def remote_invalid(self) -> list[str]:
        """Configs the GPU machine's hook reported INVALID (nothing started for them)."""
        return INVALID_LINE.findall(self.push_output)


# The hook's line for an invalid config (modules.cloud.runs.describe), as git relays it.
INVALID_LINE = re.compile(r"tempera-cloud: (\S+): INVALID, nothing started", re.MULTILINE)


def check_config_for_push(config_file: Path, repo: Path) -> list[str]:
    """Warnings for a config about to be pushed; raises CloudError on anything that must stop it."""
    findings = scan_files([config_file])
    if findings:
        raise CloudError(format_findings(findings))
    try:
        config = from_dict(read_json(config_file), source=str(config_file))
    except ConfigError as exc:
        raise CloudError(str(exc)) from None
    problems = portability_problems(config_file, repo)
    blocking = [p for p in validate(config)
                if p.path.split("[")[0] not in MACHINE_DEPENDENT]
    if problems or blocking:
        raise CloudError(str(ConfigError(problems + blocking, str(config_file))))
    return [f"{p} (the GPU machine decides)" for p in validate(config)
            if p.path.split("[")[0] in MACHINE_DEPENDENT]


def push_and_train(config: Path, repo: Path, remote: str = "origin", branch: str = "main") -> PushResult:
    """Copy a config under runs/, check it (secrets, portability, validity), commit it, push.

    Nothing is committed when the config fails a check, and nothing is pushed when any commit
    the push would send holds a secret-looking value.
    """
    repo, config = Path(repo).resolve(), Path(config).resolve()
    if not config.is_file():
        raise CloudError(f"{config} is not a file")
    if Path(git_text(["rev-parse", "--show-toplevel"], cwd=repo)).resolve() != repo:
        raise CloudError(f"{repo} is not the top folder of a git repository (tempera-cloud init)")
    runs = repo / RUNS_DIR
    target = config if config.is_relative_to(runs) else runs / config.name
    copied = target != config
    if copied:
        runs.mkdir(exist_ok=True)
        shutil.copyfile(config, target)
    rel = target.relative_to(repo).as_posix()
    try:
        warnings = check_config_for_push(target, repo)
    except CloudError:
        if copied:  # do not leave a refused (maybe secret-holding) copy in the work tree
            target.unlink()
        raise
    git(["add", "--", rel], cwd=repo)
    if not git(["diff", "--cached", "--quiet", "--", rel], cwd=repo, check=False).returncode:
        if reached_remote(repo, remote, branch):
            raise CloudError(f"{rel} is already committed unchanged; a push would start nothing "
                             "(change it, or copy it under a new name to train it again)")
        # committed by an earlier try whose push failed (offline, wrong remote): push it now
    else:
        git(["commit", "-q", "-m", f"Train {rel}", "--", rel], cwd=repo)
    commit = git_text(["rev-parse", "HEAD"], cwd=repo)
    findings = scan_outgoing(repo, remote)
    if findings:
        raise CloudError(format_findings(findings) + f"\nNothing was pushed; {rel} is committed "
                         "locally. Remove the secret from the history before pushing.")
    # The pre-push hook would scan again; skip it since the same scan just ran.
    proc = git(["push", "--no-verify", remote, f"HEAD:refs/heads/{branch}"], cwd=repo)
    output = (proc.stdout + proc.stderr).decode("utf-8", errors="replace")
    return PushResult(rel, commit, warnings, output)


def reached_remote(repo: Path, remote: str, branch: str) -> bool:
    """Whether HEAD is already on `remote`/`branch`, as far as the last fetch or push knows."""
    return not git(["merge-base", "--is-ancestor", "HEAD", f"refs/remotes/{remote}/{branch}"],
                   cwd=repo, check=False).returncode


RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def config_for_repo(config: Config, repo: Path) -> Config:
    """A copy of `config` to commit under runs/: paths inside the repository relative to runs/,
    and no output folder of this machine (cloud runs write to their own)."""
    repo = Path(repo).resolve()
    config = relativize_paths(config, repo / RUNS_DIR, root=repo)
    if Path(config.output.dir).is_absolute():  # outside the repository: this machine's
        config.output.dir = OutputConfig().dir
    return config


def push_current_config(config: Config, repo: Path, name: str, remote: str = "origin",
                        branch: str = "main") -> PushResult:
    """Write `config` as runs/<name>.json, then check, commit and push it (`push_and_train`).

    When the checks refuse it, runs/<name>.json is left as it was before (restored, or removed
    when it did not exist), so a refused config never lingers in the work tree.
    """
    if not RUN_NAME.match(name):
        raise CloudError(f"run name {name!r}: use letters, digits, '.', '_' and '-' "
                         "(it becomes runs/<name>.json)")
    repo = Path(repo).expanduser().resolve()
    if not (repo / ".git").exists():
        raise CloudError(f"{repo} is not a training repository (tempera-cloud init {repo})")
    target = repo / RUNS_DIR / f"{name}.json"
    previous = target.read_bytes() if target.is_file() else None
    target.parent.mkdir(exist_ok=True)
    save_config(config_for_repo(config, repo), target, sparse=True)
    try:
        return push_and_train(target, repo, remote, branch)
    except CloudError:
        committed = not git(["diff", "--quiet", "HEAD", "--", target.relative_to(repo).as_posix()],
                            cwd=repo, check=False).returncode
        if not committed:
            if previous is None:
                target.unlink(missing_ok=True)
            else:
                atomic_write_bytes(target, previous)
        raise
