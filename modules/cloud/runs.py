"""The one code path from a push to queued runs, shared by the git hook and GitHub Actions.

`queue_changed_runs(git_dir, before, after, settings)`: find the configs under `runs/` that the
push added or changed, export the pushed commit, validate each config exactly as tempera-train
would on this machine (with its local overrides and the run's own output folder), and queue a
run per valid config. An invalid config gets a status `invalid` with every problem and starts
nothing.
"""
from __future__ import annotations

import io
import json
import shlex
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from modules.cloud.bundles import repo_bundle_override
from modules.cloud.git import ZERO_SHA, CloudError, commit_exists, git, git_text
from modules.cloud.local_overrides import apply_local_overrides
from modules.cloud.secrets import scan_files
from modules.cloud.queue import (INVALID, PROGRESS_EVERY_SECONDS, QUEUED, RunStatus, cancel_path,
                                 cloud_run_meta, new_run_id, progress_path, write_status)
from modules.config import Config, ConfigError, apply_overrides, load_config
from modules.frontend import check
from modules.util.atomic import atomic_write_text, publish_dir_once


def default_train_command() -> list[str]:
    """This interpreter (absolute) running the trainer, so PATH on the machine does not matter."""
    return [sys.executable, "-m", "modules.cli.train"]


@dataclass
class CloudSettings:
    """How a machine runs pushed configs; stored next to the hook (`tempera-cloud.json`)."""
    work_root: Path
    branch: str = "main"
    runs_dir: str = "runs"
    local_overrides: Path | None = None
    train_command: list[str] = field(default_factory=default_train_command)

    def save(self, path: Path) -> None:
        data = {"work_root": str(self.work_root), "branch": self.branch,
                "runs_dir": self.runs_dir, "train_command": self.train_command,
                "local_overrides": str(self.local_overrides) if self.local_overrides else None}
        atomic_write_text(Path(path), json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> CloudSettings:
        data = json.loads(Path(path).read_text("utf-8"))
        local = data.get("local_overrides")
        return cls(work_root=Path(data["work_root"]), branch=data.get("branch", "main"),
                   runs_dir=data.get("runs_dir", "runs"),
                   local_overrides=Path(local) if local else None,
                   train_command=list(data["train_command"]))


def changed_configs(git_dir: Path, before: str, after: str, runs_dir: str = "runs") -> list[str]:
    """Config files (`runs/**.json`) added or changed between two commits, in commit order.

    For a new branch (before is all zeros) or a `before` this repository does not have (e.g. a
    force push after gc), every config under runs/ at `after` counts as added.
    """
    prefix = runs_dir.rstrip("/") + "/"
    if before == ZERO_SHA or not commit_exists(before, git_dir=git_dir):
        out = git(["ls-tree", "-r", "-z", "--name-only", after, "--", prefix], git_dir=git_dir)
        history = after
    else:
        out = git(["diff", "--name-only", "-z", "--no-renames", "--diff-filter=AM", before,
                   after, "--", prefix], git_dir=git_dir)
        history = f"{before}..{after}"
    names = out.stdout.decode("utf-8").split("\0")
    wanted = {n for n in names if n.startswith(prefix) and n.endswith(".json")}
    return in_commit_order(git_dir, history, prefix, wanted)


def in_commit_order(git_dir: Path, history: str, prefix: str, wanted: set[str]) -> list[str]:
    """`wanted` ordered by the first commit (oldest first) of `history` that added or changed
    each, so the configs of one push queue in the order they were committed."""
    log = git(["log", "--reverse", "--no-renames", "--format=", "--name-only", "-z",
               "--diff-filter=AM", history, "--", prefix], git_dir=git_dir).stdout.decode("utf-8")
    ordered: list[str] = []
    for name in (n.strip("\n") for n in log.split("\0")):
        if name in wanted and name not in ordered:
            ordered.append(name)
    return ordered + sorted(wanted - set(ordered))  # e.g. only changed by a merge


def config_blobs(git_dir: Path, commit: str, runs_dir: str = "runs") -> dict[str, str]:
    """`{path: blob sha}` of every config under runs/ at a commit."""
    out = git(["ls-tree", "-r", "-z", commit, "--", runs_dir.rstrip("/") + "/"], git_dir=git_dir)
    blobs = {}
    for entry in filter(None, out.stdout.decode("utf-8").split("\0")):
        meta, _, name = entry.partition("\t")
        if name.endswith(".json"):
            blobs[name] = meta.split()[2]
    return blobs


def untrained_configs(git_dir: Path, after: str, trained: dict[str, str],
                      runs_dir: str = "runs") -> list[str]:
    """Configs at `after` whose content this machine has not trained yet, in commit order.

    Compares content (blob ids) with what the machine recorded, not with the push's `before`:
    a force push or a fresh checkout does not make unchanged configs train again.
    """
    wanted = {name for name, blob in config_blobs(git_dir, after, runs_dir).items()
              if trained.get(name) != blob}
    return in_commit_order(git_dir, after, runs_dir.rstrip("/") + "/", wanted) if wanted else []


def export_commit(git_dir: Path, commit: str, checkouts: Path) -> Path:
    """`<checkouts>/<sha>`: the commit's files (git archive), created once and then reused."""
    target = Path(checkouts) / commit
    if target.is_dir():
        return target

    def extract(folder: Path) -> None:
        data = git(["archive", "--format=tar", commit], git_dir=git_dir).stdout
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:
            archive.extractall(folder, filter="data")

    return publish_dir_once(target, extract)


def queue_changed_runs(git_dir: Path, before: str, after: str, settings: CloudSettings,
                       ref: str = "", configs: list[str] | None = None) -> list[RunStatus]:
    """Queue one run per config the push added or changed (or per config of `configs`), in
    commit order; invalid ones are recorded, not run."""
    work_root = Path(settings.work_root)
    if configs is None:
        configs = changed_configs(git_dir, before, after, settings.runs_dir)
    if not configs:
        return []
    checkout = export_commit(git_dir, after, work_root / "checkouts")
    return [queue_run(checkout, after, config, settings, ref) for config in configs]


def queue_run(checkout: Path, commit: str, config: str, settings: CloudSettings,
              ref: str = "") -> RunStatus:
    """Validate one config of the checkout and write its status: queued, or invalid with why."""
    work_root = Path(settings.work_root).resolve()
    run_id = new_run_id(work_root, commit, config)
    run_dir = work_root / "runs" / run_id
    output_dir = work_root / "outputs" / run_id
    config_file = checkout / config
    command = settings.train_command + ["--config", str(config_file)]
    if settings.local_overrides:
        command += ["--local", str(settings.local_overrides)]
    command += ["--set", f"output.dir={output_dir}",
                *(arg for key, value in cloud_run_meta(commit, config, run_id).items()
                  for arg in ("--run-meta", f"{key}={value}")),
                "--progress-file", str(progress_path(work_root, run_id)),
                "--progress-every", str(PROGRESS_EVERY_SECONDS),
                "--stop-file", str(cancel_path(work_root, run_id))]
    status = RunStatus(run_id=run_id, state=QUEUED, commit=commit, config=config,
                       output_dir=str(output_dir), log=str(run_dir / "log.txt"),
                       command=command, checkout=str(checkout), ref=ref)
    problems = secret_problems(config_file, settings.local_overrides)
    problems = problems or check_config(config_file, settings.local_overrides, output_dir)
    if not problems:
        bundle_set = repo_bundle_override(checkout, effective_config(config_file,
                                                                     settings.local_overrides))
        for assignment in bundle_set:
            status.command += ["--set", assignment]
            status.notes.append(f"{assignment}: the training repository's compile bundles "
                                "(neither the config nor local.json names one)")
    if problems:
        status.state, status.problems = INVALID, problems
        status.error = f"{config} is invalid ({len(problems)} problem(s)); nothing was started"
        (run_dir / "log.txt").write_text(
            f"{status.error}:\n" + "".join(f"  - {p}\n" for p in problems), encoding="utf-8")
    write_status(work_root, status)
    return status


def secret_problems(config_file: Path, local_overrides: Path | None) -> list[str]:
    """Secret-looking values in what a run copies into its folders (config.json holds the config
    merged with the machine's overrides), so none reaches a run record, whatever path the config
    took here (a push the pre-receive hook let in, GitHub Actions, a file put in by hand)."""
    files = [config_file] + ([Path(local_overrides)] if local_overrides else [])
    return [f"{finding} (a run record must not hold secrets)"
            for finding in scan_files([f for f in files if f.is_file()])]


def effective_config(config_file: Path, local_overrides: Path | None) -> Config:
    """The config as this machine runs it: the file, then the machine's local.json."""
    config = load_config(config_file)
    return apply_local_overrides(config, local_overrides) if local_overrides else config


def check_config(config_file: Path, local_overrides: Path | None, output_dir: Path) -> list[str]:
    """The problems tempera-train would refuse this config for here (empty when it is valid)."""
    try:
        config = effective_config(config_file, local_overrides)
        config = apply_overrides(config, [f"output.dir={output_dir}"])
        return [str(p) for p in check(config)]
    except ConfigError as exc:
        return [str(p) for p in exc.problems]


def parse_train_command(text: str | None) -> list[str]:
    """`--tempera CMD` (e.g. '/opt/tempera/.venv/bin/tempera-train') as an argv list."""
    if not text:
        return default_train_command()
    argv = shlex.split(text)
    if not argv:
        raise CloudError("--tempera is empty")
    return argv


def describe(status: RunStatus) -> str:
    """One line for the pusher: what happened to this config."""
    if status.state == INVALID:
        lines = [f"tempera-cloud: {status.config}: INVALID, nothing started ({status.run_id})"]
        return "\n".join(lines + [f"tempera-cloud:   - {p}" for p in status.problems])
    return (f"tempera-cloud: {status.config}: queued as {status.run_id} "
            f"(commit {status.commit[:10]}, output {status.output_dir})")


def repo_git_dir(repo: Path) -> Path:
    """The git directory of a work tree (or a bare repository)."""
    return (Path(repo) / git_text(["rev-parse", "--git-dir"], cwd=repo)).resolve()
