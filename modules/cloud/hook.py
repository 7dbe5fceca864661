"""The bare repository's post-receive hook: queue the pushed configs, run them in the background.

`install_hook` writes `hooks/post-receive` (from templates/cloud/post-receive) and the settings
file `tempera-cloud.json` into a bare repository. Git runs the hook after a push with one line
`<old sha> <new sha> <ref>` per updated ref on stdin; `main` handles them.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from modules.cloud.git import ZERO_SHA, CloudError, git_text
from modules.cloud.pre_receive import PRE_RECEIVE_MARKER
from modules.cloud.queue import QUEUED, RunStatus, start_background_worker
from modules.cloud.runs import CloudSettings, describe, queue_changed_runs

TEMPERA_ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = TEMPERA_ROOT / "templates" / "cloud"
SETTINGS_NAME = "tempera-cloud.json"
HOOK_MARKER = "tempera-cloud post-receive hook"


def render_template(name: str, python: str, settings: Path | None = None) -> str:
    """A hook template with the absolute interpreter, Tempera folder and settings file filled in."""
    path = TEMPLATES / name
    if not path.is_file():
        raise CloudError(f"hook template {path} is missing: install-hook needs a Tempera checkout")
    text = path.read_text("utf-8")
    text = text.replace("@PYTHON@", shlex.quote(str(Path(python).absolute())))
    text = text.replace("@TEMPERA_ROOT@", shlex.quote(str(TEMPERA_ROOT)))
    return text.replace("@SETTINGS@", shlex.quote(str(settings)) if settings else "")


def write_hook(path: Path, text: str, marker: str, force: bool) -> None:
    """Write an executable hook; refuse to replace a hook that is not ours unless forced."""
    if path.exists() and marker not in path.read_text("utf-8", errors="replace") and not force:
        raise CloudError(f"{path} exists and was not written by tempera-cloud; "
                         "merge it by hand or pass --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)


def install_hook(bare: Path, settings: CloudSettings, python: str | None = None,
                 force: bool = False) -> Path:
    """Install the pre-receive (secrets) and post-receive (queue) hooks and the settings into a
    bare repository; return the post-receive hook."""
    bare = Path(bare).resolve()
    if git_text(["rev-parse", "--is-bare-repository"], git_dir=bare) != "true":
        raise CloudError(f"{bare} is not a bare git repository (create one with "
                         f"`git init --bare {bare}`)")
    if settings.local_overrides and not Path(settings.local_overrides).is_file():
        raise CloudError(f"local overrides file {settings.local_overrides} does not exist")
    settings.work_root = Path(settings.work_root).resolve()
    settings.work_root.mkdir(parents=True, exist_ok=True)
    settings_file = bare / SETTINGS_NAME
    settings.save(settings_file)
    python = python or sys.executable
    write_hook(bare / "hooks" / "pre-receive", render_template("pre-receive", python),
               PRE_RECEIVE_MARKER, force)
    hook = bare / "hooks" / "post-receive"
    write_hook(hook, render_template("post-receive", python, settings_file), HOOK_MARKER, force)
    return hook


def handle_push(git_dir: Path, ref_lines: list[str], settings: CloudSettings) -> list[RunStatus]:
    """Queue runs for every update of the configured branch; other refs and deletions are ignored."""
    wanted = f"refs/heads/{settings.branch}"
    statuses: list[RunStatus] = []
    for line in ref_lines:
        parts = line.split()
        if len(parts) != 3:
            continue
        before, after, ref = parts
        if ref != wanted or after == ZERO_SHA:
            continue
        statuses += queue_changed_runs(git_dir, before, after, settings, ref=ref)
    return statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tempera-cloud-hook",
                                     description="post-receive hook: queue pushed configs")
    parser.add_argument("--git-dir", type=Path, required=True)
    parser.add_argument("--settings", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        settings = CloudSettings.load(args.settings)
        statuses = handle_push(args.git_dir.resolve(), sys.stdin.read().splitlines(), settings)
    except (CloudError, OSError, ValueError, KeyError) as exc:
        # The push itself has succeeded; say loudly that no run was queued and why.
        print(f"tempera-cloud: error: no run queued: {exc}", file=sys.stderr)
        return 1
    for status in statuses:
        print(describe(status))
    if not statuses:
        print(f"tempera-cloud: no config under {settings.runs_dir}/ was added or changed on "
              f"{settings.branch}; nothing to train")
    if any(s.state == QUEUED for s in statuses):
        start_background_worker(settings.work_root)
        print(f"tempera-cloud: training in the background on this machine; "
              f"see `tempera-cloud status --remote <host>:{settings.work_root}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
