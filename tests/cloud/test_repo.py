"""`init`, `push-and-train`, the pre-push hook, portability and local overrides."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from modules.cli.train import main as train_main
from modules.cloud.cli import main as cloud_main
from modules.cloud.local_overrides import apply_local_overrides
from modules.cloud.portable import portability_problems
from modules.cloud.repo import init_training_repo
from modules.cloud.secrets import scan_text
from modules.config import Config, ConfigError, apply_overrides

from .conftest import git, sparse_config, write_json

HF = "hf_" + "Zq9" * 12


@pytest.fixture
def repo_and_remote(tmp_path):
    bare = tmp_path / "remote.git"
    subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(bare)], check=True)
    repo = tmp_path / "training"
    init_training_repo(repo)
    git(repo, "remote", "add", "origin", str(bare))
    git(repo, "push", "-q", "origin", "main")
    return repo, bare


def test_init_makes_a_training_repo_that_ignores_outputs_secrets_and_local_overrides(tmp_path):
    repo = tmp_path / "t"
    assert cloud_main(["init", str(repo)]) == 0
    ignored = (repo / ".gitignore").read_text().split()
    for pattern in ("outputs/", "local.json", "*.secrets*", ".tempera/"):
        assert pattern in ignored
    assert (repo / "runs").is_dir() and "runs/" in (repo / "README.md").read_text()
    assert os.access(repo / ".git" / "hooks" / "pre-push", os.X_OK)
    assert git(repo, "status", "--porcelain") == ""  # everything it wrote is committed
    for name in ("local.json", "hub.secrets.json", "outputs/x/run.json"):
        write_json(repo / name, {"k": 1})
    assert git(repo, "status", "--porcelain") == ""  # and all of these are ignored
    assert cloud_main(["init", str(repo)]) == 0  # idempotent


def test_push_and_train_commits_the_config_under_runs_and_pushes_it(repo_and_remote, tmp_path):
    repo, bare = repo_and_remote
    config = write_json(tmp_path / "elsewhere" / "cats.json",
                        sparse_config(compile={"backend": "AOT_EAGER"}, sampling={"prompts": []}))
    assert cloud_main(["push-and-train", str(config), "--repo", str(repo)]) == 0
    assert git(bare, "log", "-1", "--format=%s", "main") == "Train runs/cats.json"
    pushed = json.loads(git(bare, "show", "main:runs/cats.json"))
    assert pushed["compile"]["backend"] == "AOT_EAGER"
    # The same config again: refused, since a push would start nothing.
    assert cloud_main(["push-and-train", str(config), "--repo", str(repo)]) == 1


def test_push_and_train_refuses_a_config_with_a_token_and_commits_nothing(
        repo_and_remote, tmp_path, capsys):
    repo, bare = repo_and_remote
    head, remote_head = git(repo, "rev-parse", "HEAD"), git(bare, "rev-parse", "main")
    config = write_json(tmp_path / "leaky.json", {"config_version": 1, "hub_token": HF})
    assert cloud_main(["push-and-train", str(config), "--repo", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "secret-looking" in err and "leaky.json:1" not in err and HF not in err
    assert git(repo, "rev-parse", "HEAD") == head and git(bare, "rev-parse", "main") == remote_head
    assert not (repo / "runs" / "leaky.json").exists()  # the refused copy is not left behind


def test_nothing_is_pushed_when_an_earlier_local_commit_holds_a_secret(repo_and_remote, tmp_path):
    repo, bare = repo_and_remote
    remote_head = git(bare, "rev-parse", "main")
    (repo / "notes.txt").write_text(f"my token {HF}\n")
    git(repo, "add", "notes.txt")
    git(repo, "commit", "-q", "-m", "oops")
    config = write_json(tmp_path / "ok.json", sparse_config(sampling={"prompts": []}))
    assert cloud_main(["push-and-train", str(config), "--repo", str(repo)]) == 1
    assert git(bare, "rev-parse", "main") == remote_head
    # A plain `git push` is stopped by the pre-push hook `init` installed.
    proc = subprocess.run(["git", "push", "origin", "main"], cwd=repo, capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "notes.txt" in proc.stderr and HF not in proc.stderr
    assert git(bare, "rev-parse", "main") == remote_head
    log = subprocess.run(["git", "log", "-p", "--all"], cwd=bare, capture_output=True, text=True)
    assert scan_text(log.stdout, "bare history") == []


def test_push_and_train_refuses_machine_specific_and_invalid_configs(repo_and_remote, tmp_path,
                                                                     capsys):
    repo, bare = repo_and_remote
    remote_head = git(bare, "rev-parse", "main")
    absolute = write_json(tmp_path / "abs.json", sparse_config(
        data={"datasets": [{"path": str(tmp_path / "images")}]}))
    assert cloud_main(["push-and-train", str(absolute), "--repo", str(repo)]) == 1
    assert "local.json" in capsys.readouterr().err
    invalid = write_json(tmp_path / "inv.json", sparse_config(data={"resolution": 100}))
    assert cloud_main(["push-and-train", str(invalid), "--repo", str(repo)]) == 1
    assert "multiple of 64" in capsys.readouterr().err
    assert git(bare, "rev-parse", "main") == remote_head


def test_portability_allows_builtins_and_repo_paths_and_flags_the_rest(tmp_path):
    repo = tmp_path / "repo"
    config = write_json(repo / "runs" / "c.json", sparse_config(
        general={"cache_dir": "/home/me/.cache/tempera"},
        model={"path": "builtin:tiny-sd15"},
        data={"datasets": [{"path": "../data/cats"}, {"path": "../../outside"},
                           {"path": "~/pics"}]},
        output={"dir": "/anywhere"}))
    problems = {p.path: p for p in portability_problems(config, repo)}
    assert set(problems) == {"general.cache_dir", "data.datasets[1].path",
                             "data.datasets[2].path"}
    assert "inside the training repository" in problems["data.datasets[1].path"].expected


def test_local_overrides_sit_between_the_config_and_set(tmp_path):
    local = write_json(tmp_path / "machine" / "local.json", {
        "data.datasets[0].path": "disk/cats", "general.device": "CPU",
        "training.max_steps": 7, "sampling.prompts": ["a cat"]})
    config = apply_local_overrides(Config(), local)
    assert config.data.datasets[0].path == str(tmp_path / "machine" / "disk" / "cats")
    assert config.general.device.value == "CPU" and config.sampling.prompts == ["a cat"]
    assert apply_overrides(config, ["training.max_steps=3"]).training.max_steps == 3
    bad = write_json(tmp_path / "bad.json", {"training.max_stepz": 1})
    with pytest.raises(ConfigError, match="local overrides"):
        apply_local_overrides(Config(), bad)


def test_tempera_train_local_flag_supplies_the_machine_dataset(tmp_path, capsys):
    (tmp_path / "disk" / "cats").mkdir(parents=True)
    from PIL import Image
    Image.new("RGB", (64, 64), "orange").save(tmp_path / "disk" / "cats" / "cat.png")
    config = write_json(tmp_path / "repo" / "runs" / "c.json", sparse_config(
        data={"datasets": [{"path": "../data/cats"}]}, output={"dir": "../outputs/c"}))
    local = write_json(tmp_path / "local.json", {"data.datasets[0].path": "disk/cats"})
    assert train_main(["--config", str(config), "--check"]) == 2
    assert "data.datasets[0].path" in capsys.readouterr().err
    assert train_main(["--config", str(config), "--local", str(local), "--check"]) == 0
    assert train_main(["--config", str(config), "--local", str(tmp_path / "nope.json"),
                       "--check"]) == 2


def test_pushing_the_current_settings_writes_repo_paths_relative_to_runs(repo_and_remote,
                                                                          tmp_path):
    from modules.cloud.git import CloudError
    from modules.cloud.repo import push_current_config
    repo, bare = repo_and_remote
    (repo / "data" / "cats").mkdir(parents=True)
    config = apply_overrides(Config(), [f"data.datasets=[{{\"path\": \"{repo / 'data' / 'cats'}\"}}]",
                                        f"output.dir={tmp_path / 'local-out'}",
                                        "compile.backend=AOT_EAGER"])
    result = push_current_config(config, repo, "cats")
    assert result.config == "runs/cats.json"
    pushed = json.loads(git(bare, "show", "main:runs/cats.json"))
    assert pushed["data"]["datasets"][0]["path"] == "../data/cats"
    assert "output" not in pushed  # this computer's output folder stays here
    assert pushed["compile"]["backend"] == "AOT_EAGER"

    with pytest.raises(CloudError, match="run name"):
        push_current_config(config, repo, "runs/../../x")
    with pytest.raises(CloudError, match="not a training repository"):
        push_current_config(config, tmp_path / "elsewhere", "cats")
    assert not (tmp_path / "elsewhere").exists()


def test_a_push_that_failed_is_retried_without_a_second_commit(repo_and_remote, tmp_path):
    repo, bare = repo_and_remote
    config = write_json(tmp_path / "cats.json", sparse_config(sampling={"prompts": []}))
    moved = bare.rename(tmp_path / "away.git")  # the machine is unreachable
    assert cloud_main(["push-and-train", str(config), "--repo", str(repo)]) == 1
    committed = git(repo, "rev-parse", "HEAD")
    assert git(repo, "log", "-1", "--format=%s") == "Train runs/cats.json"
    moved.rename(bare)  # back online: the same command pushes the commit it made
    assert cloud_main(["push-and-train", str(config), "--repo", str(repo)]) == 0
    assert git(repo, "rev-parse", "HEAD") == committed
    assert git(bare, "rev-parse", "main") == committed
    # and now that it is there, pushing it again is refused: it would start nothing
    assert cloud_main(["push-and-train", str(config), "--repo", str(repo)]) == 1
