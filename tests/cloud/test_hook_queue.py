"""The post-receive hook and the queue, with a fake trainer: which pushes start what, and how."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from modules.cloud.cli import main as cloud_main
from modules.cloud.git import CloudError
from modules.cloud.hook import install_hook
from modules.cloud.queue import list_statuses, read_status, wait_for
from modules.cloud.runs import CloudSettings, changed_configs

from .conftest import git, sparse_config, write_json


def config_sleeping(tenths: int, seed: int = 42) -> dict:
    """A valid config; the fake trainer sleeps `tenths`/10 s and exits seed-100 for 101..109."""
    return sparse_config(sampling={"prompts": [], "steps": tenths}, training={"seed": seed})


def test_installed_hook_records_absolute_interpreter_and_settings(tmp_path, fake_train):
    bare = tmp_path / "b.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
    hook = install_hook(bare, CloudSettings(work_root=tmp_path / "w", train_command=fake_train),
                        python="/opt/py/bin/python3")
    text = hook.read_text()
    assert os.access(hook, os.X_OK)
    assert "exec /opt/py/bin/python3 -m modules.cloud.hook" in text
    settings = json.loads((bare / "tempera-cloud.json").read_text())
    assert settings["train_command"] == fake_train
    assert settings["work_root"] == str((tmp_path / "w").resolve())


def test_install_hook_refuses_a_work_tree_and_a_foreign_hook(tmp_path, fake_train):
    settings = CloudSettings(work_root=tmp_path / "w", train_command=fake_train)
    work_tree = tmp_path / "wt"
    subprocess.run(["git", "init", "-q", str(work_tree)], check=True)
    with pytest.raises(CloudError, match="not a bare git repository"):
        install_hook(work_tree / ".git", settings)
    bare = tmp_path / "b.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
    (bare / "hooks" / "post-receive").write_text("#!/bin/sh\necho mine\n")
    with pytest.raises(CloudError, match="not written by tempera-cloud"):
        install_hook(bare, settings)
    assert "echo mine" in (bare / "hooks" / "post-receive").read_text()


def test_push_queues_changed_configs_runs_them_one_at_a_time_in_the_background(
        make_cloud, fake_train):
    cloud = make_cloud(fake_train, local={"general.device": "CPU"})
    started = time.monotonic()
    output = cloud.commit_and_push({"runs/a.json": config_sleeping(8),
                                    "runs/b.json": config_sleeping(8),
                                    "notes.txt": "not a config"}, "two runs")
    push_seconds = time.monotonic() - started
    ids = cloud.run_ids()
    assert len(ids) == 2 and "queued as" in output
    # The push came back before the (2 x 0.8 s) runs were done: they run in the background.
    assert any(read_status(cloud.work_root, r).state != "finished" for r in ids), push_seconds
    # A second push right away starts a second worker; the queue lock keeps it to one run at a time.
    cloud.commit_and_push({"runs/c.json": config_sleeping(8)}, "third run")
    ids = cloud.run_ids()
    statuses = wait_for(cloud.work_root, ids, timeout=60)
    assert [s.state for s in statuses] == ["finished"] * 3
    assert [s.config for s in statuses] == ["runs/a.json", "runs/b.json", "runs/c.json"]
    records = [json.loads((Path(s.output_dir) / "run.json").read_text()) for s in statuses]
    spans = sorted((r["started"], r["ended"]) for r in records)
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), spans
    # Each run has its own output folder, the commit it ran, the local overrides passed.
    assert len({s.output_dir for s in statuses}) == 3
    assert {r["meta"]["commit"] for r in records[:2]} == {git(cloud.repo, "rev-parse", "HEAD~1")}
    assert records[2]["meta"]["commit"] == cloud.head() and all(r["local"] for r in records)
    for s in statuses:
        assert s.exit_code == 0 and s.started_at and s.ended_at >= s.started_at
        assert "fake trainer ran" in Path(s.log).read_text()


def test_unchanged_configs_start_nothing_and_a_changed_one_starts_one_run(make_cloud, fake_train):
    cloud = make_cloud(fake_train)
    cloud.commit_and_push({"runs/a.json": config_sleeping(1), "runs/b.json": config_sleeping(1)})
    wait_for(cloud.work_root, cloud.run_ids(), timeout=60)
    output = cloud.commit_and_push({"README.md": "edited\n"}, "docs only")
    assert "nothing to train" in output and len(cloud.run_ids()) == 2
    cloud.commit_and_push({"runs/b.json": config_sleeping(2)}, "change b")
    ids = cloud.run_ids()
    assert len(ids) == 3
    assert read_status(cloud.work_root, ids[-1]).config == "runs/b.json"
    wait_for(cloud.work_root, ids, timeout=60)


def test_invalid_config_is_recorded_with_its_problems_and_starts_nothing(make_cloud, fake_train):
    cloud = make_cloud(fake_train)
    bad = sparse_config(data={"resolution": 100, "datasets": [{"path": "missing"}]},
                        training={"max_stepz": 3})
    output = cloud.commit_and_push({"runs/bad.json": bad, "runs/bad2.json": sparse_config(
        data={"resolution": 100}, sampling={"prompts": []})})
    statuses = list_statuses(cloud.work_root)
    assert [s.state for s in statuses] == ["invalid", "invalid"]
    by_config = {s.config: s for s in statuses}
    assert any("training.max_stepz" in p and "did you mean 'max_steps'" in p
               for p in by_config["runs/bad.json"].problems)
    assert any("data.resolution" in p and "multiple of 64" in p
               for p in by_config["runs/bad2.json"].problems)
    assert "INVALID, nothing started" in output and "data.resolution" in output
    for s in statuses:
        assert s.exit_code is None and s.started_at is None
        assert not Path(s.output_dir).exists()
        assert "invalid" in Path(s.log).read_text()
    time.sleep(0.5)
    assert not (cloud.work_root / "outputs").exists()  # no worker ran anything


def test_missing_dataset_is_invalid_unless_the_machine_overrides_it(make_cloud, fake_train, tmp_path):
    images = tmp_path / "cloud-disk" / "cats"
    images.mkdir(parents=True)
    cloud = make_cloud(fake_train, local={"data.datasets[0].path": "../cloud-disk/cats"})
    config = sparse_config(data={"datasets": [{"path": "data/cats"}]}, sampling={"prompts": []})
    cloud.commit_and_push({"runs/cats.json": config})
    (status,) = list_statuses(cloud.work_root)
    assert status.state != "invalid", status.problems
    wait_for(cloud.work_root, [status.run_id], timeout=60)
    # Without the machine's override the same config is refused with the dotted path.
    cloud.settings.local_overrides = None
    install_hook(cloud.bare, cloud.settings)
    cloud.commit_and_push({"runs/cats.json": {**config, "training": {"seed": 7}}})
    last = list_statuses(cloud.work_root)[-1]
    assert last.state == "invalid"
    assert any("data.datasets[0].path" in p and "no such folder" in p for p in last.problems)


def test_failed_training_is_recorded_with_its_exit_code(make_cloud, fake_train):
    cloud = make_cloud(fake_train)
    cloud.commit_and_push({"runs/fails.json": config_sleeping(1, seed=103)})
    (status,) = wait_for(cloud.work_root, cloud.run_ids(), timeout=60)
    assert status.state == "failed" and status.exit_code == 3
    assert "exited with 3" in status.error


def test_pushes_to_other_branches_and_deletions_start_nothing(make_cloud, fake_train):
    cloud = make_cloud(fake_train)
    git(cloud.repo, "checkout", "-q", "-b", "experiment")
    write_json(cloud.repo / "runs" / "x.json", config_sleeping(1))
    git(cloud.repo, "add", "-A")
    git(cloud.repo, "commit", "-q", "-m", "x")
    git(cloud.repo, "push", "-q", "origin", "experiment")
    git(cloud.repo, "push", "-q", "origin", "--delete", "experiment")
    assert cloud.run_ids() == []


def test_changed_configs_new_branch_lists_all_and_a_diff_lists_added_or_modified(tmp_path):
    repo = tmp_path / "r"
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    for name in ("runs/a.json", "runs/b.json", "runs/sub/c.json", "runs/notes.md", "other.json"):
        write_json(repo / name, {})
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "one")
    first = git(repo, "rev-parse", "HEAD")
    gd = repo / ".git"
    assert changed_configs(gd, "0" * 40, first) == ["runs/a.json", "runs/b.json",
                                                    "runs/sub/c.json"]
    write_json(repo / "runs" / "a.json", {"x": 1})
    (repo / "runs" / "b.json").unlink()
    write_json(repo / "runs" / "d.json", {})
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "two")
    assert changed_configs(gd, first, git(repo, "rev-parse", "HEAD")) == ["runs/a.json",
                                                                          "runs/d.json"]


def test_run_changed_for_actions_uses_the_same_path_and_waits(tmp_path, fake_train, capsys):
    repo = tmp_path / "checkout"
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    write_json(repo / "README.md", {})
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    before = git(repo, "rev-parse", "HEAD")
    write_json(repo / "runs" / "ok.json", config_sleeping(1))
    write_json(repo / "runs" / "bad.json", sparse_config(data={"resolution": 100}))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "runs")
    after = git(repo, "rev-parse", "HEAD")
    work = tmp_path / "work"
    argv = ["run-changed", "--repo", str(repo), "--before", before, "--after", after,
            "--work-root", str(work), "--tempera", shlex.join(fake_train)]
    assert cloud_main(argv) == 1  # one invalid config fails the job
    states = {s.config: s.state for s in list_statuses(work)}
    assert states == {"runs/ok.json": "finished", "runs/bad.json": "invalid"}
    out = capsys.readouterr().out
    assert "runs/bad.json: INVALID" in out and ": finished" in out
    # before == after: nothing changed, nothing to train.
    assert cloud_main(argv[:4] + [after, "--after", after] + argv[7:]) == 0
    assert "nothing to train" in capsys.readouterr().out
