"""The rest of the journey: Actions (record, cancel, logs), fetch, progress, push-and-train's
exit code for an INVALID config, commit order."""
from __future__ import annotations

import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path


from modules.cli.progress import ProgressReporter, progress_line, watch_stop_file
from modules.cloud.cli import main as cloud_main
from modules.cloud.fetch import fetch_run, rsync_command, scp_command
from modules.cloud.queue import CANCELLED, list_statuses
from modules.cloud.remote_status import Remote, observe_command, parse_observation
from modules.cloud.runs import changed_configs
from modules.events import NullCallbacks, Progress, TrainerCommands
from tests.child_env import with_repo_on_pythonpath

from .conftest import git, sparse_config, wait_until, write_json

REPO = Path(__file__).resolve().parents[2]


def commit(repo: Path, files: dict, message: str) -> str:
    for name, data in files.items():
        write_json(repo / name, data)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def quick(n: int = 1) -> dict:
    return sparse_config(sampling={"prompts": [], "steps": n})


def test_configs_of_one_push_queue_in_commit_order(tmp_path):
    repo = tmp_path / "r"
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    base = commit(repo, {"README.json": {}}, "base")
    for name in ("zebra", "apple", "mango"):  # not alphabetical
        after = commit(repo, {f"runs/{name}.json": {}}, name)
    assert changed_configs(repo / ".git", base, after) == ["runs/zebra.json", "runs/apple.json",
                                                           "runs/mango.json"]
    assert changed_configs(repo / ".git", "0" * 40, after)[0] == "runs/zebra.json"


def test_actions_retrains_nothing_after_a_force_push_or_on_a_fresh_checkout(tmp_path, fake_train,
                                                                             capsys):
    repo = tmp_path / "checkout"
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    base = commit(repo, {"runs/old.json": quick()}, "there before the workflow")
    first = commit(repo, {"runs/a.json": quick(), "runs/b.json": quick()}, "two runs")
    work = tmp_path / "work"
    argv = ["run-changed", "--repo", str(repo), "--before", base, "--after", first,
            "--work-root", str(work), "--tempera", shlex.join(fake_train),
            "--record-key", "me/cats", "--copy-logs", str(tmp_path / "logs")]
    assert cloud_main(argv) == 0
    assert len(list(work.glob("runs/*"))) == 2
    assert sorted(p.suffix for p in (tmp_path / "logs").iterdir()) == [".log", ".log"]
    # Rewrite history (amend = a force push) and check it out fresh: a's content is unchanged.
    assert "runs/old.json" not in [s.config for s in list_statuses(work)]
    git(repo, "commit", "-q", "--amend", "-m", "rewritten")
    after = commit(repo, {"runs/b.json": quick(2)}, "change b")
    fresh = tmp_path / "fresh"
    subprocess.run(["git", "clone", "-q", str(repo), str(fresh)], check=True)
    capsys.readouterr()
    assert cloud_main(argv[:2] + [str(fresh), "--before", "0" * 40, "--after", after]
                      + argv[7:]) == 0
    queued = [s.config for s in list_statuses(work)][2:]
    assert queued == ["runs/b.json"]  # neither a nor old is trained


def test_a_cancelled_actions_job_leaves_its_run_cancelled_without_a_traceback(tmp_path):
    from .test_supervise import SLOW_TRAIN
    script = tmp_path / "slow.py"
    script.write_text(SLOW_TRAIN)
    repo = tmp_path / "checkout"
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    after = commit(repo, {"runs/long.json": quick(600), "runs/next.json": quick(1)}, "runs")
    work = tmp_path / "work"
    env = with_repo_on_pythonpath()
    job = subprocess.Popen([sys.executable, "-m", "modules.cloud.cli", "run-changed", "--repo",
                            str(repo), "--after", after, "--work-root", str(work), "--tempera",
                            f"{sys.executable} {script}"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: any(s.state == "running" for s in list_statuses(work)), timeout=30)
        job.send_signal(signal.SIGTERM)  # what the runner does when the workflow is cancelled
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 130 and "Traceback" not in err, err
    assert {s.state for s in list_statuses(work)} == {CANCELLED}
    long = next(s for s in list_statuses(work) if s.config == "runs/long.json")
    assert json.loads((Path(long.output_dir) / "run.json").read_text())["status"] in (
        "stopped", "cancelled")


def test_actions_template_queues_instead_of_cancelling_and_uploads_logs():
    text = (REPO / "templates" / "cloud" / "github-actions.yml").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "concurrency" not in code and "cancel-in-progress" not in code
    assert "--record-key" in text and "actions/upload-artifact" in text
    assert "--copy-logs" in text


def test_fetch_from_a_local_work_root_is_resumable(tmp_path):
    out = tmp_path / "work" / "outputs" / "run1"
    write_json(out / "final" / "w.json", {"w": 1})
    write_json(out / "samples" / "s.json", {})
    write_json(out / "run.json", {"status": "finished"})
    dest = tmp_path / "here"
    assert cloud_main(["fetch", "run1", "--remote", str(tmp_path / "work"), "--to",
                       str(dest)]) == 0
    assert (dest / "final" / "w.json").is_file() and (dest / "run.json").is_file()
    assert not (dest / "samples").exists()
    report = fetch_run(Remote(str(tmp_path / "work")), "run1", "all", dest)
    assert report == [f".: 1 file(s) copied to {dest}"]  # only the file not there yet
    assert cloud_main(["fetch", "nope", "--remote", str(tmp_path / "work"), "--to",
                       str(dest)]) == 1


def test_fetch_commands_for_rsync_and_scp(tmp_path):
    remote = Remote("/srv/my work", "me@gpu", 2222)
    rsync = rsync_command(remote, "run1", "final", tmp_path)
    assert rsync[:4] == ["rsync", "-a", "--partial", "--relative"]
    assert rsync[5] == "ssh -o BatchMode=yes -p 2222"
    assert rsync[6] == "me@gpu:'/srv/my work/outputs/run1/./final'"
    scp = scp_command(remote, "run1", "final", tmp_path)
    assert scp[:6] == ["scp", "-r", "-p", "-o", "BatchMode=yes", "-P"]
    assert scp[-2] == "me@gpu:'/srv/my work/outputs/run1/final'"


def test_progress_reporter_writes_a_clean_line_and_json_every_n_seconds(tmp_path):
    now = [0.0]
    stream = io.StringIO()
    reporter = ProgressReporter(NullCallbacks(), tmp_path / "progress.json", every=30,
                                stream=stream, clock=lambda: now[0])
    for step in range(1, 11):
        now[0] = step * 10.0
        reporter.on_progress(Progress(step, 10, 1, 1, 0.5, 0.25, 1e-4, 0.5, (10 - step) * 0.5))
    lines = stream.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["1/10", "4/10", "7/10", "10/10"]
    assert lines[0] == "[progress] step 1/10 (10%)  loss 0.2500  2.00 it/s  ETA 0:04"
    data = json.loads((tmp_path / "progress.json").read_text())
    assert data["step"] == 10 and data["it_per_s"] == 2.0
    assert "\r" not in stream.getvalue()  # no tqdm bar in a log
    assert "compile: UNet" in progress_line({**data, "compile": "UNet done"})


def test_stop_file_requests_a_stop(tmp_path):
    commands, said = TrainerCommands(), []
    done = watch_stop_file(tmp_path / "cancel", commands, said.append, poll=0.05)
    (tmp_path / "cancel").touch()
    wait_until(lambda: commands.stop_requested, timeout=10)
    done.set()
    assert "stop file" in said[0]


def test_status_over_ssh_shows_progress_and_liveness(tmp_path):
    from modules.cloud.queue import RunStatus
    s = RunStatus(run_id="r1", state="running", commit="a" * 40, config="runs/a.json",
                  output_dir=str(tmp_path / "o"), log="", train_pid=os.getpid(),
                  boot_id="b", proc_start="1")
    write_json(tmp_path / "runs" / "r1" / "progress.json", {"step": 3, "max_steps": 9})
    write_json(tmp_path / "o" / "run.json", {"status": "running"})
    out = subprocess.run(["sh", "-c", observe_command(str(tmp_path), [s])], capture_output=True,
                         text=True, check=True).stdout
    boot, starts, progress, cancelling, records = parse_observation(out)
    assert starts[os.getpid()] and progress["r1"]["step"] == 3 and records["r1"] == "running"
    assert not cancelling


def test_push_and_train_fails_when_the_machine_finds_the_config_invalid(make_cloud, fake_train,
                                                                        tmp_path, capsys):
    cloud = make_cloud(fake_train, local={"data.datasets[0].path": "/no/such/cloud/folder"})
    config = write_json(tmp_path / "cats.json", sparse_config(
        data={"datasets": [{"path": "data"}]}, sampling={"prompts": []}))
    (cloud.repo / "data").mkdir()
    (cloud.repo / "data" / "a.txt").write_text("x")
    git(cloud.repo, "add", "-A")
    git(cloud.repo, "commit", "-q", "-m", "data")
    assert cloud_main(["push-and-train", str(config), "--repo", str(cloud.repo)]) == 1
    err = capsys.readouterr().err
    assert "runs/cats.json INVALID" in err


def test_docs_and_readme_match_the_code():
    docs = (REPO / "docs" / "cloud.md").read_text()
    assert "git init --bare -b main" in docs and "git init --bare /" not in docs
    for command in ("fetch", "cancel", "--follow", "work --daemon", "pre-receive"):
        assert command in docs, command
    readme = (REPO / "README.md").read_text()
    assert "checkpoints/step-NNNNNN/" in readme
    assert (REPO / "templates" / "cloud" / "tempera-cloud-worker.service").is_file()


def test_status_follow_shows_progress_until_no_run_is_active(tmp_path, capsys):
    from modules.cloud.queue import RunStatus, write_status
    from modules.cloud.supervise import identity
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    try:
        write_status(tmp_path, RunStatus(
            run_id="r1", state="running", commit="a" * 40, config="runs/a.json",
            output_dir=str(tmp_path / "o"), log=str(tmp_path / "runs" / "r1" / "log.txt"),
            **identity(trainer.pid)))
        write_json(tmp_path / "runs" / "r1" / "progress.json",
                   {"step": 5, "max_steps": 50, "loss": 0.5, "eta_seconds": 90})
        started = time.monotonic()
        assert cloud_main(["status", "--remote", str(tmp_path), "--follow", "--every", "0.2"]) == 0
        assert time.monotonic() - started < 30
    finally:
        trainer.kill()
        trainer.wait()
    tables = capsys.readouterr().out.split("\n\n")
    assert len(tables) >= 2 and "5/50" in tables[0] and "1:30" in tables[0]
    assert "interrupted" in tables[-1]  # its process ended without a worker to record it
