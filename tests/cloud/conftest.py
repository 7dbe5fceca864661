"""Fixtures for the cloud tests: git identities, a bare "cloud" repo with the hook, a fake trainer."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modules.cloud.hook import install_hook
from modules.cloud.queue import list_statuses
from modules.cloud.repo import init_training_repo
from modules.cloud.runs import CloudSettings
from modules.config.schema import CONFIG_VERSION

# A stand-in for tempera-train that takes the same arguments: it records when it ran, writes a
# run.json with its --run-meta, sleeps, and exits with `training.seed - 100` for a seed in 101..109
# (so a config can ask it to fail). Real training is covered once in test_push_to_train_e2e.py.
FAKE_TRAIN = r'''
import json, sys, time
from pathlib import Path
args = sys.argv[1:]
config = Path(args[args.index("--config") + 1])
sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
meta = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--run-meta")
out = Path([s.split("=", 1)[1] for s in sets if s.startswith("output.dir=")][0])
out.mkdir(parents=True)
started = time.time()
data = json.loads(config.read_text())
time.sleep(data.get("sampling", {}).get("steps", 1) / 10)
seed = data.get("training", {}).get("seed", 42)
print("fake trainer ran", config)
(out / "run.json").write_text(json.dumps({"status": "finished", "meta": meta,
    "started": started, "ended": time.time(), "local": "--local" in args}))
sys.exit(seed - 100 if 100 < seed < 110 else 0)
'''


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(autouse=True)
def git_identity(monkeypatch):
    """Commits need an author; tests never depend on the user's git config for one."""
    for kind in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{kind}_NAME", "Test")
        monkeypatch.setenv(f"GIT_{kind}_EMAIL", "test@example.com")


@pytest.fixture
def fake_train(tmp_path) -> list[str]:
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    return [sys.executable, str(script)]


def sparse_config(**sections) -> dict:
    """A config file holding only `sections`, at the current schema version (a test of
    migration writes its old version itself)."""
    return {"config_version": CONFIG_VERSION, **sections}


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


class Cloud:
    """A bare repo with the hook installed (the GPU machine) and a training repo (the laptop)."""

    def __init__(self, root: Path, train_command: list[str], local: dict | None = None):
        self.bare = root / "cloud.git"
        self.work_root = root / "work"
        self.repo = root / "training"
        subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(self.bare)], check=True)
        local_file = write_json(root / "machine" / "local.json", local) if local else None
        self.settings = CloudSettings(work_root=self.work_root, local_overrides=local_file,
                                      train_command=train_command)
        install_hook(self.bare, self.settings)
        init_training_repo(self.repo)
        git(self.repo, "remote", "add", "origin", str(self.bare))
        git(self.repo, "push", "-q", "origin", "main")

    def commit_and_push(self, files: dict[str, dict | str], message: str = "change") -> str:
        """Write files into the training repo, commit them, push; return git push's output."""
        for name, content in files.items():
            path = self.repo / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
        git(self.repo, "add", "-A")
        git(self.repo, "commit", "-q", "-m", message)
        proc = subprocess.run(["git", "push", "origin", "main"], cwd=self.repo, check=True,
                              capture_output=True, text=True)
        return proc.stdout + proc.stderr

    def run_ids(self) -> list[str]:
        return [s.run_id for s in list_statuses(self.work_root)]

    def head(self) -> str:
        return git(self.repo, "rev-parse", "HEAD")


@pytest.fixture
def make_cloud(tmp_path):
    def make(train_command: list[str], local: dict | None = None) -> Cloud:
        return Cloud(tmp_path, train_command, local)
    return make


def wait_until(predicate, timeout: float = 60.0, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError("condition not met in time")
