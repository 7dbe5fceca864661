"""Resume through `tempera-train`: SIGTERM stops with a backup and exit 143, kill -9 at any
moment (also while a backup is being written) leaves a run that `--resume` finishes exactly.
One run takes the three interruptions in turn (each child pays seconds of imports)."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from modules.cli.train import main
from modules.train.state.backup_files import list_backups
from tests.child_env import with_repo_on_pythonpath
from tests.cli.run_settings import backed_up_run

REPO = Path(__file__).resolve().parents[2]
STEPS = 12


def write_config(folder: Path, cache: Path, name: str) -> Path:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(backed_up_run(cache, name, STEPS)))
    return path


def start(config: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "scripts" / "train.py"), "--config",
                             str(config), "--quiet", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=with_repo_on_pythonpath())


def wait_for(condition, timeout: float = 240.0, every: float = 0.002) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return False


def record(output: Path) -> dict:
    return json.loads((output / "run.json").read_text())


def reference_run(folder: Path, cache: Path) -> dict:
    """The uninterrupted run every interrupted one must match, trained in this process by the
    command's own `main` (the interrupted runs' last part is resumed here too: a run in this
    process and one in a child compute alike, tests/conftest.py's thread share)."""
    config = write_config(folder, cache, "whole")
    assert main(["--config", str(config), "--quiet"]) == 0
    return record(folder / "whole")


def latest_backup(output: Path) -> int:
    found = list_backups(output)
    return found[-1][0] if found else 0


def test_sigterm_then_kill_9_at_random_moments_then_resume_matches_the_uninterrupted_run(
        tmp_path, tempera_cache):
    """One run interrupted three ways in turn, each process resuming the last one's backups:
    SIGTERM (finishes the step, writes a backup, exits 143 saying how to resume), kill -9
    while a backup is being written, kill -9 at a random moment inside a step; `--resume`
    then finishes it with the uninterrupted run's losses, step by step."""
    reference = reference_run(tmp_path, tempera_cache)
    config = write_config(tmp_path, tempera_cache, "run")
    output = tmp_path / "run"
    rng = random.Random(1234)
    backups = output / "backups"

    proc = start(config)
    assert wait_for(lambda: list_backups(output)), proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err
    assert "--resume latest" in err
    stopped = record(output)
    assert stopped["status"] == "stopped"
    assert latest_backup(output) == stopped["steps_done"]
    assert stopped["steps_done"] < STEPS // 2, "the stop came too late for the kills"

    def writing_a_backup() -> bool:  # a hidden temporary folder: a backup is being written
        return backups.is_dir() and any(p.name.startswith(".") for p in backups.iterdir())

    # 1st kill: while a later backup is being written (or as close as polling gets), and
    # within the first half of the run, so that the resumed run has steps left to be killed in
    proc = start(config, "--resume")
    assert wait_for(lambda: latest_backup(output) > stopped["steps_done"]
                    or writing_a_backup())
    wait_for(lambda: writing_a_backup() or latest_backup(output) >= STEPS // 2, every=0.0005)
    proc.kill()
    proc.wait()
    # 2nd kill: at a random moment inside a step of the resumed run, with at least one more
    # step to go. The moment is drawn in units of a step as measured on this machine: a fixed
    # sleep let a fast machine finish the run before the kill.
    steps_before = latest_backup(output)
    assert steps_before <= STEPS // 2 + 1
    target = rng.randint(steps_before + 2, STEPS - 2)
    proc = start(config, "--resume")
    assert wait_for(lambda: latest_backup(output) >= target - 1)
    seen = time.monotonic()
    assert wait_for(lambda: latest_backup(output) >= target)
    time.sleep(rng.uniform(0.0, time.monotonic() - seen))
    assert proc.poll() is None, "the resumed run ended before it could be killed"
    proc.kill()
    proc.wait()
    assert record(output)["status"] == "running"  # what a killed process leaves behind
    assert main(["--config", str(config), "--resume", "--quiet"]) == 0
    final = record(output)
    assert final["status"] == "finished" and final["resume_count"] >= 3
    assert final["losses"] == reference["losses"]
    # a partly written backup was never picked, and the next start removed it
    assert not any(p.name.startswith(".") for p in (output / "backups").iterdir())
