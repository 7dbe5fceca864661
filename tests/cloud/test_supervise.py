"""Runs a user can trust after a kill or a reboot: no orphaned `running`, no doubled training."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modules.cloud.fetch import cancel_run
from modules.cloud.queue import (CANCELLED, FAILED, FINISHED, QUEUED, RUNNING, RunStatus,
                                 list_statuses, process_queue, read_status, write_status)
from modules.cloud.remote_status import Remote, format_table, read_views
from modules.cloud.supervise import is_alive, local_is_alive, parse_proc_start, process_start
from tests.child_env import with_repo_on_pythonpath

from .conftest import sparse_config, wait_until

# A trainer that runs `sampling.steps`/10 s: run.json says running at once, progress.json is
# written, a --stop-file ends it with status "stopped" (as tempera-train's stop with a save does).
# Two files beside the script let a test decide when things happen instead of guessing with
# sleeps: while `hold` exists the trainer waits before it writes anything (a trainer killed
# before its first record), and once `finish` exists it ends at once with status "finished".
SLOW_TRAIN = r'''
import json, sys, time
from pathlib import Path
args = sys.argv[1:]
def opt(name):
    return args[args.index(name) + 1] if name in args else None
hold, finish = Path(__file__).with_name("hold"), Path(__file__).with_name("finish")
while hold.exists():
    time.sleep(0.05)
config = Path(opt("--config"))
out = Path([args[i + 1].split("=", 1)[1] for i, a in enumerate(args)
            if a == "--set" and args[i + 1].startswith("output.dir=")][0])
out.mkdir(parents=True)
(out / "run.json").write_text(json.dumps({"status": "running"}))
end = time.time() + json.loads(config.read_text())["sampling"]["steps"] / 10
stop, progress, step = opt("--stop-file"), opt("--progress-file"), 0
while time.time() < end and not finish.exists():
    step += 1
    if progress:
        Path(progress).write_text(json.dumps({"step": step, "max_steps": 1000, "loss": 0.25,
                                              "eta_seconds": 125, "it_per_s": 20.0}))
    if stop and Path(stop).exists():
        (out / "run.json").write_text(json.dumps({"status": "stopped"}))
        sys.exit(0)
    time.sleep(0.05)
(out / "run.json").write_text(json.dumps({"status": "finished", "ended": time.time()}))
'''


@pytest.fixture
def slow_train(tmp_path) -> list[str]:
    script = tmp_path / "slow_train.py"
    script.write_text(SLOW_TRAIN)
    return [sys.executable, str(script)]


@pytest.fixture
def cleanup_pids():
    pids: list[int] = []
    yield pids
    for pid in pids:  # processes this test started, ended by their own id
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def tenths(n: int) -> dict:
    return sparse_config(sampling={"prompts": [], "steps": n})


def status_of(cloud, config: str) -> RunStatus:
    return next(s for s in list_statuses(cloud.work_root) if s.config == config)


def running(cloud, config: str) -> RunStatus | None:
    s = status_of(cloud, config)
    return s if s.state == RUNNING and s.train_pid else None


def gone(status: RunStatus) -> bool:
    return not local_is_alive(status.train_pid, status.boot_id, status.proc_start)


# sampling.steps' largest valid value: 100 s, more than any test waits; such a run is ended by
# finish_file or a kill, never by its own clock (a busy machine cannot end it too early).
UNTIL_FINISHED = 1000


def hold_file(slow_train: list[str]) -> Path:
    """While it exists, SLOW_TRAIN waits before writing anything."""
    return Path(slow_train[1]).with_name("hold")


def finish_file(slow_train: list[str]) -> Path:
    """Once it exists, every SLOW_TRAIN ends at once with status finished."""
    return Path(slow_train[1]).with_name("finish")


def record_of(output_dir: str) -> dict | None:
    try:
        return json.loads((Path(output_dir) / "run.json").read_text())
    except (OSError, ValueError):  # not written yet (or being written: the fake is not atomic)
        return None


def record_says_running(status: RunStatus) -> bool:
    return (record_of(status.output_dir) or {}).get("status") == "running"


def process_gone(pid: int) -> bool:
    """The process has ended (an unreaped zombie counts as ended, see parse_proc_start)."""
    return process_start(pid) == ""


def lock_is_held(work_root: Path) -> bool:
    with open(work_root / "queue.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def test_process_identity_tells_reboots_reused_pids_and_zombies():
    line = "123 (python my train) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 4242 99 0"
    assert parse_proc_start(line) == "4242"
    assert parse_proc_start(line.replace(") S", ") Z")) == ""  # ended, not reaped: gone
    assert is_alive(123, "boot-a", "4242", "boot-a", "4242")
    assert not is_alive(123, "boot-a", "4242", "boot-b", "4242")  # rebooted since
    assert not is_alive(123, "boot-a", "4242", "boot-a", "5000")  # pid reused
    assert not is_alive(123, "boot-a", "4242", "boot-a", "")  # gone
    assert not is_alive(None, "", "", "", None)


def run_then_kill_its_worker(make_cloud, slow_train, cleanup_pids):
    """A pushed run training until finish_file, then its worker killed with SIGKILL (the
    trainer lives on)."""
    cloud = make_cloud(slow_train)
    cloud.commit_and_push({"runs/a.json": tenths(UNTIL_FINISHED)})
    a = wait_until(lambda: running(cloud, "runs/a.json"), timeout=60)
    cleanup_pids.append(a.train_pid)
    os.kill(a.worker_pid, signal.SIGKILL)
    wait_until(lambda: process_gone(a.worker_pid), timeout=30)
    return cloud, a


def test_a_killed_worker_leaves_an_orphan_that_still_holds_the_lock(make_cloud, slow_train,
                                                                    cleanup_pids):
    cloud, a = run_then_kill_its_worker(make_cloud, slow_train, cleanup_pids)
    assert not gone(a) and lock_is_held(cloud.work_root)  # the orphan trains on, lock and all
    cloud.commit_and_push({"runs/b.json": tenths(1)})  # its worker must not start b beside a
    # b's worker found the lock held and returned without running anything (no earlier worker
    # wrote this line: a's was killed mid-run)
    wait_until(lambda: "ran 0 run(s)" in (cloud.work_root / "worker.log").read_text(),
               timeout=60)
    assert status_of(cloud, "runs/b.json").state == QUEUED
    assert [v.state for v in read_views(Remote(str(cloud.work_root)))] == [RUNNING, QUEUED]
    finish_file(slow_train).touch()
    wait_until(lambda: gone(a), timeout=60)
    orphan_ended = time.time()
    view = read_views(Remote(str(cloud.work_root)))[0]
    assert (view.status.state, view.state) == (RUNNING, FINISHED)  # shown as its run.json says
    assert not lock_is_held(cloud.work_root)
    process_queue(cloud.work_root)  # the next worker start (a push, the daemon) reconciles
    a, b = status_of(cloud, "runs/a.json"), status_of(cloud, "runs/b.json")
    assert a.state == FINISHED and any("no worker" in note for note in a.notes)
    assert b.state == FINISHED and b.started_at >= orphan_ended - 0.5


# Where a kill lands: before the trainer wrote its first run.json (held by hold_file: on a busy
# machine a trainer is often killed there) or after it wrote "running".
KILLED = ["before_its_record", "after_its_record"]


def kill_trainer_at(when: str, status: RunStatus, slow_train: list[str]) -> None:
    """SIGKILL the run's trainer at `when` (KILLED); it must be held when "before"."""
    if when == "after_its_record":
        wait_until(lambda: record_says_running(status), timeout=60)
    else:
        assert hold_file(slow_train).exists() and record_of(status.output_dir) is None
    os.kill(status.train_pid, signal.SIGKILL)
    wait_until(lambda: gone(status), timeout=30)


@pytest.mark.parametrize("when", KILLED)
def test_a_run_killed_with_its_worker_is_interrupted_and_starts_again(make_cloud, slow_train,
                                                                     cleanup_pids, when):
    if when == "before_its_record":
        hold_file(slow_train).touch()
    cloud, a = run_then_kill_its_worker(make_cloud, slow_train, cleanup_pids)
    kill_trainer_at(when, a, slow_train)
    hold_file(slow_train).unlink(missing_ok=True)
    finish_file(slow_train).touch()  # the restarted attempt writes its record and finishes
    (view,) = read_views(Remote(str(cloud.work_root)))
    assert view.state == "interrupted" and "restarts it" in format_table([view])
    process_queue(cloud.work_root)
    a = read_status(cloud.work_root, a.run_id)
    assert a.state == FINISHED and a.restarts == 1
    kept = json.loads((Path(a.output_dir + ".attempt-0") / "run.json").read_text())
    assert kept["status"] == "interrupted" and "no worker watched it" in kept["error"]
    if when == "before_its_record":  # written by the worker, traceable like the trainer's
        assert kept["meta"] == {"commit": a.commit, "config": "runs/a.json",
                                "cloud_run_id": a.run_id}
    assert json.loads((Path(a.output_dir) / "run.json").read_text())["status"] == "finished"


@pytest.mark.parametrize("when", KILLED)
def test_a_killed_trainer_is_failed_in_status_and_in_its_run_json(make_cloud, slow_train,
                                                                  cleanup_pids, when):
    if when == "before_its_record":
        hold_file(slow_train).touch()
    cloud = make_cloud(slow_train)
    cloud.commit_and_push({"runs/a.json": tenths(UNTIL_FINISHED)})
    a = wait_until(lambda: running(cloud, "runs/a.json"), timeout=60)
    cleanup_pids.append(a.train_pid)
    kill_trainer_at(when, a, slow_train)
    a = wait_until(lambda: (s := status_of(cloud, "runs/a.json")).state == FAILED and s, timeout=60)
    assert a.exit_code == -9 and "SIGKILL" in a.error
    record = json.loads((Path(a.output_dir) / "run.json").read_text())
    assert record["status"] == "failed" and "SIGKILL" in record["error"]
    if when == "before_its_record":
        assert record["meta"]["commit"] == cloud.head() == a.commit


def test_cancel_a_queued_and_a_running_run(make_cloud, slow_train):
    cloud = make_cloud(slow_train)
    cloud.commit_and_push({"runs/a.json": tenths(200), "runs/b.json": tenths(1)})
    a = wait_until(lambda: running(cloud, "runs/a.json"), timeout=60)
    wait_until(lambda: (cloud.work_root / "runs" / a.run_id / "progress.json").exists())
    assert "1000" in format_table(read_views(Remote(str(cloud.work_root))))  # STEP n/1000
    remote = Remote(str(cloud.work_root))
    b = status_of(cloud, "runs/b.json")
    assert "will not start" in cancel_run(remote, b.run_id)
    cancel_run(remote, a.run_id)
    wait_until(lambda: all(s.state == CANCELLED for s in list_statuses(cloud.work_root)),
               timeout=60)
    assert json.loads((Path(a.output_dir) / "run.json").read_text())["status"] == "stopped"
    assert not Path(b.output_dir).exists()  # never started


def test_daemon_starts_queued_and_interrupted_runs_after_a_reboot(tmp_path, slow_train):
    work_root = tmp_path / "work"
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tenths(1)))
    for name, state in (("20250101-000000-aaaaaaaa-before-reboot", RUNNING),
                        ("20250101-000001-aaaaaaaa-queued", QUEUED)):
        out = work_root / "outputs" / name
        (work_root / "runs" / name).mkdir(parents=True)
        write_status(work_root, RunStatus(
            run_id=name, state=state, commit="a" * 40, config="runs/c.json", output_dir=str(out),
            log=str(work_root / "runs" / name / "log.txt"),
            command=slow_train + ["--config", str(config), "--set", f"output.dir={out}"],
            train_pid=os.getpid(), boot_id="a boot before this one", proc_start="1"))
    env = with_repo_on_pythonpath()
    daemon = subprocess.Popen([sys.executable, "-m", "modules.cloud.cli", "work", "--daemon",
                               "--poll", "0.2", "--work-root", str(work_root)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: all(s.state == FINISHED for s in list_statuses(work_root)), timeout=60)
    finally:
        daemon.kill()
        daemon.wait(timeout=10)
    assert [s.restarts for s in list_statuses(work_root)] == [1, 0]


def test_an_interrupted_run_with_a_backup_resumes_in_place(tmp_path):
    from modules.cloud.supervise import restart_command
    output = tmp_path / "outputs" / "r1"
    backup = output / "backups" / "step-000040"
    backup.mkdir(parents=True)
    (backup / "backup.json").write_text("{}")
    (backup / "tensors.safetensors").write_bytes(b"")
    status = RunStatus(run_id="r1", config="runs/a.json", commit="c", state="interrupted",
                       output_dir=str(output), log=str(tmp_path / "log"),
                       command=["python", "-m", "modules.cli.train", "--config", "a.json"])
    assert restart_command(status, tmp_path) == [*status.command, "--resume"]
    assert output.is_dir() and "resumed from step-000040 (step 40)" in status.notes[-1]


def test_a_run_that_keeps_dying_is_failed_after_the_restart_limit(make_cloud, slow_train):
    from modules.cloud.queue import reconcile
    from modules.cloud.supervise import MAX_RESTARTS
    cloud = make_cloud(slow_train)
    status = RunStatus(run_id="r9", config="runs/a.json", commit="c", state=RUNNING,
                       output_dir=str(cloud.work_root / "outputs" / "r9"),
                       log=str(cloud.work_root / "r9.log"), command=slow_train,
                       train_pid=2**22 + 7, restarts=MAX_RESTARTS)  # a pid that is not alive
    write_status(cloud.work_root, status)
    reconcile(cloud.work_root)
    after = read_status(cloud.work_root, "r9")
    assert after.state == FAILED and "not started again" in after.error


def test_settle_writes_a_missing_record_changes_running_and_keeps_the_trainers_word(tmp_path):
    from modules.cloud.supervise import settle_run_record
    meta = {"commit": "c" * 40, "config": "runs/a.json", "cloud_run_id": "r1"}
    never_written = tmp_path / "never"
    assert settle_run_record(never_written, FAILED, "killed by SIGKILL", meta)
    record = json.loads((never_written / "run.json").read_text())
    assert (record["status"], record["error"]) == (FAILED, "killed by SIGKILL")
    assert record["meta"] == meta
    for said, changed in (("running", True), ("stopped", False), ("failed", False)):
        out = tmp_path / said
        out.mkdir()
        (out / "run.json").write_text(json.dumps({"status": said, "losses": [0.5]}))
        assert settle_run_record(out, CANCELLED, "cancelled", meta) is changed
        after = json.loads((out / "run.json").read_text())
        assert after["status"] == (CANCELLED if changed else said) and after["losses"] == [0.5]
