"""Compile bundles in cloud runs: the training repository's bundles/ reaches the run, the bundle a
run wrote comes back (fetch, add-bundle) and the next run starts warm from it; status says how
each run started. The trainer is a stand-in that looks for its bundle with the real lookup
(find_bundle) and writes run.json's compile_bundle with the real BundleKeeper record; loading
and writing real compiled code is tests/compile/test_bundle.py's and
tests/train/test_compile_ahead.py's."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from modules.cloud.bundles import (add_bundle, collect_written_bundle, compile_start_summary,
                                   describe_compile_start)
from modules.cloud.cli import main as cloud_main
from modules.cloud.fetch import fetch_run
from modules.cloud.git import CloudError
from modules.cloud.queue import (RunStatus, read_status, wait_for, wait_noting_compile_start,
                                 write_status)
from modules.cloud.remote_status import Remote, format_table, read_views
from modules.cloud.runs import CloudSettings, queue_run
from tests.child_env import REPO
from tests.compile.bundle_files import PRINT, fake_bundle

from .conftest import git, sparse_config, wait_until, write_json

H200 = dataclasses.replace(PRINT, device="NVIDIA H200", capability="9.0", cuda="12.8")
A100 = dataclasses.replace(H200, device="NVIDIA A100-SXM4-80GB", capability="8.0")

# A stand-in for tempera-train on "an H200": it looks in compile.bundle (the --set the worker
# adds) for the bundle made for H200 with the real lookup, records what it found as the real
# BundleKeeper does, and writes its own bundle into this machine's cache folder.
BUNDLE_TRAIN = r'''
import json, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from modules.compile.bundle import BundleKeeper, Fingerprint, find_bundle
from tests.compile.bundle_files import fake_bundle
args = sys.argv[1:]
sets = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--set")
out = Path(sets["output.dir"])
out.mkdir(parents=True)
gpu = Fingerprint.from_dict(json.loads({fingerprint!r}))
cache = Path({cache!r})
keeper = BundleKeeper(gpu, [Path(sets["compile.bundle"])] if "compile.bundle" in sets else [],
                      cache)
keeper.lookup = find_bundle(gpu, keeper.places)
if keeper.lookup.status == "hit":  # as if loaded: made by a 60 s cold compile, 18.4 s now
    keeper.loaded_entries, keeper.cold_seconds = 3, 60.0
record = keeper.record(compile_seconds=18.4)
keeper.written = fake_bundle(cache, gpu)
record["written"] = str(keeper.written)
(out / "run.json").write_text(json.dumps({{"status": "finished", "compile_bundle": record}}))
'''


@pytest.fixture
def bundle_train(tmp_path) -> list[str]:
    script = tmp_path / "bundle_train.py"
    script.write_text(BUNDLE_TRAIN.format(repo=str(REPO), cache=str(tmp_path / "gpu-cache"),
                                          fingerprint=json.dumps(dataclasses.asdict(H200))))
    return [sys.executable, str(script)]


def quick() -> dict:
    return sparse_config(sampling={"prompts": []})


def test_init_makes_a_committed_bundles_folder_the_readme_explains(tmp_path):
    from modules.cloud.repo import init_training_repo
    init_training_repo(tmp_path / "repo")
    assert "bundles/.gitkeep" in git(tmp_path / "repo", "ls-files")
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert "bundles/" in readme and "add-bundle" in readme


def test_a_run_starts_cold_then_the_next_push_carries_its_bundle_and_starts_warm(
        make_cloud, bundle_train, tmp_path, capsys):
    """The whole loop through real git pushes, hooks and the background worker: two runs, each
    a worker and a trainer process (about 15 s here), which no single-function test covers."""
    cloud = make_cloud(bundle_train)
    add_bundle(fake_bundle(tmp_path / "elsewhere", A100), cloud.repo)  # another GPU's
    cloud.commit_and_push({"runs/a.json": quick()}, "first run")
    [first] = wait_for(cloud.work_root, cloud.run_ids(), timeout=60)
    assert first.state == "finished", Path(first.log).read_text()
    checkout_bundles = Path(first.checkout) / "bundles"
    at = first.command.index(f"compile.bundle={checkout_bundles}")
    assert first.command[at - 1] == "--set"
    # The A100 bundle was looked at, named and not used; the run wrote its own.
    assert first.compile_bundle["lookup"] == "mismatch"
    assert "device: this run NVIDIA H200, bundle NVIDIA A100" in first.compile_bundle["why"]
    written = Path(first.output_dir) / "bundles" / H200.file_name()
    assert written.is_file() and first.compile_bundle["written"] == H200.file_name()
    assert "compile: cold, bundle mismatch: device: this run NVIDIA H200" in \
        format_table(read_views(Remote(str(cloud.work_root))))

    capsys.readouterr()
    assert cloud_main(["fetch", first.run_id, "--remote", str(cloud.work_root), "--what",
                       "bundle", "--to", str(tmp_path / "fetched"), "--add-to-repo",
                       str(cloud.repo)]) == 0
    assert f"added bundles/{H200.file_name()}" in capsys.readouterr().out
    assert f"bundles/{H200.file_name()}" in git(cloud.repo, "ls-files")
    assert git(cloud.repo, "status", "--porcelain") == ""

    cloud.commit_and_push({"runs/b.json": quick()}, "second run")
    second = wait_for(cloud.work_root, cloud.run_ids(), timeout=60)[1]
    assert second.compile_bundle["lookup"] == "hit"
    assert second.compile_bundle["found"] == H200.file_name()
    assert cloud_main(["status", "--remote", str(cloud.work_root)]) == 0
    table = capsys.readouterr().out
    assert f"compile: warm from bundle {H200.file_name()} (saved 42 s)" in table
    views = json.loads(_status_json(cloud.work_root, capsys))
    assert [v["compile_bundle"]["lookup"] for v in views] == ["mismatch", "hit"]


def _status_json(work_root: Path, capsys) -> str:
    assert cloud_main(["status", "--remote", str(work_root), "--json"]) == 0
    return capsys.readouterr().out


def _checkout(tmp_path: Path, config: dict, bundles: bool = True) -> Path:
    checkout = tmp_path / "checkout"
    write_json(checkout / "runs" / "a.json", config)
    if bundles:
        (checkout / "bundles").mkdir()
    return checkout


@pytest.mark.parametrize("case", ["config", "local", "bundles off", "no folder"])
def test_the_repo_bundles_are_not_set_over_a_choice_already_made(tmp_path, case):
    own = tmp_path / "own.tcb"
    compile_section = {"config": {"bundle": str(own)},
                       "bundles off": {"bundles": False}}.get(case, {})
    checkout = _checkout(tmp_path, sparse_config(sampling={"prompts": []},
                                                 compile=compile_section),
                         bundles=case != "no folder")
    local = write_json(tmp_path / "local.json", {"compile.bundle": str(own)}) \
        if case == "local" else None
    settings = CloudSettings(work_root=tmp_path / "work", local_overrides=local)
    status = queue_run(checkout, "a" * 40, "runs/a.json", settings)
    assert status.state == "queued", status.problems
    assert not any(arg.startswith("compile.bundle=") for arg in status.command)
    assert not any("compile bundles" in note for note in status.notes)
    plain = queue_run(_checkout(tmp_path / "plain", quick()), "a" * 40, "runs/a.json",
                      CloudSettings(work_root=tmp_path / "work"))
    assert any(note.startswith("compile.bundle=") for note in plain.notes)  # the control


def test_status_shows_how_a_run_started_while_it_still_trains(tmp_path):
    out = tmp_path / "out"
    status = RunStatus(run_id="r1", state="running", commit="a" * 40, config="runs/a.json",
                       output_dir=str(out), log=str(tmp_path / "log.txt"))
    write_status(tmp_path, status)
    record = {"status": "running", "compile_bundle": {"lookup": "miss", "why": "no bundle"}}
    trainer = subprocess.Popen([sys.executable, "-c", (
        "import json, pathlib, time; o = pathlib.Path(%r); o.mkdir(); "
        "(o / 'run.json').write_text(json.dumps(%r)); "
        "[time.sleep(0.05) for _ in range(400) if not (o / 'done').exists()]") % (
            str(out), record)])
    try:
        # The worker's wait polls run.json; status.json has the answer before the run ends.
        result: list[int] = []
        waiter = threading.Thread(target=lambda: result.append(
            wait_noting_compile_start(trainer, tmp_path, status, poll=0.05)))
        waiter.start()
        wait_until(lambda: read_status(tmp_path, "r1").compile_bundle, timeout=20)
        assert trainer.poll() is None  # still training
        (out / "done").touch()
        waiter.join(timeout=20)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert result == [0]
    assert "compile: cold (no bundle for this GPU)" in format_table(
        read_views(Remote(str(tmp_path))))


@pytest.mark.parametrize("record, text", [
    (None, ""),
    ({"lookup": "hit", "found": "/c/bundles/sd15-1.tcb"}, "compile: warm from bundle sd15-1.tcb"),
    ({"lookup": "hit", "found": "/c/sd15-1.tcb", "seconds_saved": 12.4},
     "compile: warm from bundle sd15-1.tcb (saved 12 s)"),
    ({"lookup": "miss", "why": "no bundle for these settings yet"},
     "compile: cold (no bundle for this GPU)"),
    ({"lookup": "mismatch", "why": "torch: this run 2.13.0, bundle 2.12.0"},
     "compile: cold, bundle mismatch: torch: this run 2.13.0, bundle 2.12.0"),
    ({"lookup": "damaged", "why": "x.tcb is not a whole compile bundle"},
     "compile: cold, bundle damaged: x.tcb is not a whole compile bundle"),
])
def test_how_a_run_started_in_one_phrase(record, text):
    assert describe_compile_start(compile_start_summary(record)) == text


def test_a_bundle_that_cannot_be_brought_back_is_noted_and_fetch_says_why(tmp_path):
    out = tmp_path / "work" / "outputs" / "r1"
    write_json(out / "run.json", {"status": "finished",
                                  "compile_bundle": {"written": str(tmp_path / "gone.tcb")}})
    note = collect_written_bundle(out)
    assert note is not None and "gone.tcb not copied" in note
    with pytest.raises(CloudError, match="wrote no compile bundle"):
        fetch_run(Remote(str(tmp_path / "work")), "r1", "bundle", tmp_path / "here")


def test_add_bundle_refuses_a_damaged_file_and_replaces_the_same_settings(tmp_path):
    from modules.cloud.repo import init_training_repo
    repo = tmp_path / "repo"
    init_training_repo(repo)
    damaged = tmp_path / "x.tcb"
    damaged.write_bytes(fake_bundle(tmp_path / "b", H200).read_bytes()[:50])
    with pytest.raises(CloudError, match="not a whole compile bundle"):
        add_bundle(damaged, repo)
    first = add_bundle(fake_bundle(tmp_path / "b", H200, name="any-name.tcb"), repo)
    assert first[0].startswith(f"added bundles/{H200.file_name()}: SD15 on NVIDIA H200")
    again = add_bundle(fake_bundle(tmp_path / "c", H200, artifacts=b"more code"), repo)
    assert again[0].startswith("replaced") and "committed" in again[1]
    assert len(list((repo / "bundles").glob("*.tcb"))) == 1
    in_place = add_bundle(repo / "bundles" / H200.file_name(), repo)  # not copied onto itself
    assert in_place[1].startswith("the same file is committed already")
    assert git(repo, "status", "--porcelain") == ""


def test_the_docs_name_the_commands_and_options_that_exist():
    from modules.cloud.cli import parse_args
    docs = (REPO / "docs" / "cloud.md").read_text()
    for text in ("add-bundle", "--what bundle", "--add-to-repo", "compile: warm from bundle",
                 "compile: cold (no bundle for this GPU)", "outputs/<run-id>/bundles/"):
        assert text in docs, text
    args = parse_args(["fetch", "r1", "--remote", "w", "--what", "bundle", "--add-to-repo", "r"])
    assert (args.what, args.add_to_repo) == ("bundle", Path("r"))
    assert parse_args(["add-bundle", "x.tcb", "--no-commit"]).no_commit
