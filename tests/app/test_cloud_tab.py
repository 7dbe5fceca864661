"""The Cloud tab: push the form to a training repository, refusals that change nothing, status."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from app.settings import load_settings
from modules.cloud.queue import RunStatus, write_status
from modules.cloud.repo import init_training_repo
from modules.cloud.supervise import identity
from tests.app.conftest import REPO, pump


@pytest.fixture(autouse=True)
def git_identity(monkeypatch):
    for kind in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{kind}_NAME", "Test")
        monkeypatch.setenv(f"GIT_{kind}_EMAIL", "test@example.com")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def training_repo(tmp_path) -> tuple[Path, Path]:
    """A training repo whose origin is a bare repository standing in for the GPU machine."""
    repo, bare = tmp_path / "cats-training", tmp_path / "cloud.git"
    init_training_repo(repo)
    git(tmp_path, "init", "-q", "--bare", "-b", "main", str(bare))
    git(repo, "remote", "add", "origin", str(bare))
    return repo, bare


def fill(app, repo: Path, name: str = "", status: str = "") -> None:
    panel = app.cloud_panel
    panel.set_entry(panel.entries["cloud_repo"], str(repo))
    panel.set_entry(panel.entries["cloud_status"], status)
    panel.set_entry(panel.name_entry, name)


def wait_idle(app) -> None:
    pump(app, lambda: not app.cloud_panel.busy, timeout=60)


def test_push_and_train_commits_the_form_with_its_compile_settings(make_app, training_repo,
                                                                   tmp_path):
    repo, bare = training_repo
    app = make_app(initial_preset=REPO / "training_presets" / "demo.json")
    app.registry.find("compile.backend").var.set("AOT_EAGER")
    app.registry.find("compile.text_encoder").var.set(True)
    fill(app, repo, name="cats-v1")
    assert app.cloud_panel.push()
    wait_idle(app)

    assert "Pushed runs/cats-v1.json" in app.cloud_panel.text(), app.cloud_panel.text()
    assert git(bare, "log", "-1", "--format=%s", "main") == "Train runs/cats-v1.json"
    pushed = json.loads(git(bare, "show", "main:runs/cats-v1.json"))
    assert pushed["compile"]["backend"] == "AOT_EAGER"
    assert pushed["compile"]["text_encoder"] is True
    assert pushed["training"]["max_steps"] == 400  # the preset's, written sparse like a preset
    # no path of this computer goes into the repository
    assert str(tmp_path) not in json.dumps(pushed)
    assert not Path(pushed.get("output", {}).get("dir", "output")).is_absolute()
    # where to push is remembered with the GUI settings, not in the config
    saved, _ = load_settings(app.settings_path)
    assert saved.cloud_repo == str(repo) and saved.cloud_remote == "origin"


def test_a_refused_config_changes_nothing_in_the_repository(make_app, training_repo, tmp_path):
    repo, bare = training_repo
    earlier = repo / "runs" / "cats.json"
    earlier.write_text('{"training": {"max_steps": 5}}\n')
    git(repo, "add", "runs/cats.json")
    git(repo, "commit", "-q", "-m", "earlier run")
    head = git(repo, "rev-parse", "HEAD")
    outside = tmp_path / "my-photos"  # a folder outside the repository: not in a clone
    outside.mkdir()
    app = make_app(initial_preset=REPO / "training_presets" / "demo.json")
    app.registry.find("data.datasets[0].path").var.set(str(outside))
    fill(app, repo, name="cats")
    assert app.cloud_panel.push()
    wait_idle(app)

    text = app.cloud_panel.text()
    assert text.startswith("Not pushed"), text
    assert "data.datasets[0].path" in text and "local.json" in text
    assert earlier.read_text() == '{"training": {"max_steps": 5}}\n'  # restored as it was
    assert git(repo, "rev-parse", "HEAD") == head
    assert git(repo, "status", "--porcelain") == ""
    assert subprocess.run(["git", "rev-parse", "--verify", "-q", "main"], cwd=bare,
                          capture_output=True).returncode != 0  # nothing reached the remote


def test_missing_settings_and_bad_run_names_are_reported(make_app, training_repo):
    repo, _ = training_repo
    app = make_app(initial_preset=REPO / "training_presets" / "demo.json")
    fill(app, "")
    assert not app.cloud_panel.push()
    assert "Fill in: Training repository" in app.cloud_panel.text()

    fill(app, repo, name="../escape")
    assert app.cloud_panel.push()
    wait_idle(app)
    assert "run name '../escape'" in app.cloud_panel.text()
    assert sorted(p.name for p in (repo / "runs").iterdir()) == [".gitkeep"]


def test_refresh_status_shows_the_runs_and_the_latest_log(make_app, tmp_path):
    work_root = tmp_path / "work"
    status = RunStatus(run_id="20261123-0001-cats", state="running", commit="a" * 40,
                       config="runs/cats.json", output_dir=str(work_root / "outputs" / "cats"),
                       log=str(work_root / "runs" / "20261123-0001-cats" / "log.txt"),
                       **identity(os.getpid()))  # a live process: this test's
    write_status(work_root, status)
    Path(status.log).write_text("step 3/400 loss 0.41\n")
    (Path(status.log).parent / "progress.json").write_text(json.dumps(
        {"step": 3, "max_steps": 400, "loss": 0.41, "eta_seconds": 754, "it_per_s": 0.5}))
    app = make_app(initial_preset=REPO / "training_presets" / "demo.json")
    app.cloud_panel.set_entry(app.cloud_panel.entries["cloud_status"], str(work_root))
    assert app.cloud_panel.refresh_status()
    wait_idle(app)
    text = app.cloud_panel.text()
    assert "20261123-0001-cats" in text and "running" in text
    assert "step 3/400 loss 0.41" in text
    row = next(line for line in text.splitlines() if line.startswith("20261123-0001-cats"))
    assert "3/400" in row and "0.4100" in row and "12:34" in row  # step, loss, ETA

    app.cloud_panel.set_entry(app.cloud_panel.entries["cloud_status"], str(tmp_path / "none"))
    assert app.cloud_panel.refresh_status()
    wait_idle(app)
    assert "Could not read the runs" in app.cloud_panel.text()
