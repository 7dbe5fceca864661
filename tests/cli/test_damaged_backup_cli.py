"""A damaged backup through `tempera-train` (scripts/train.py as a process, stopped by a real
SIGTERM): `--resume latest` passes over it to the newest intact one and says which and why;
naming it explicitly exits 2 naming the file, with nothing in the output folder touched."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from modules.train.state.backup_files import TENSORS, list_backups
from tests.child_env import with_repo_on_pythonpath
from tests.cli.test_resume_cli import REPO, wait_for
from tests.train.test_backup_integrity import fingerprint, truncate
from tests.cli.run_settings import backed_up_run


def write_config(folder: Path, cache: Path) -> Path:
    path = folder / "run.json.config"
    path.write_text(json.dumps(backed_up_run(cache, "run", 40)))
    return path


def train_process(config: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "scripts" / "train.py"), "--config",
                             str(config), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=with_repo_on_pythonpath())


def stopped_run(tmp_path: Path, cache: Path) -> tuple[Path, Path]:
    """A run stopped by SIGTERM once it has two backups; (config, output folder)."""
    config = write_config(tmp_path, cache)
    output = tmp_path / "run"
    proc = train_process(config, "--quiet")
    assert wait_for(lambda: len(list_backups(output)) >= 2), proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err
    return config, output


def test_a_damaged_newest_backup_named_exits_2_and_latest_passes_over_it(tmp_path,
                                                                       tempera_cache):
    """One stopped run, its newest backup truncated: named explicitly, the command exits 2
    naming the file and touches nothing; then `--resume latest` passes over it to the older,
    intact one and says which and why."""
    config, output = stopped_run(tmp_path, tempera_cache)
    (older_step, older), (_, newest) = list_backups(output)[-2:]
    truncate(newest)
    before = fingerprint(output)
    proc = train_process(config, "--resume", str(newest))
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2, err
    assert str(newest / TENSORS) in err and "cannot be read" in err, err
    assert fingerprint(output) == before
    assert json.loads((output / "run.json").read_text())["status"] == "stopped"

    proc = train_process(config, "--resume", "latest", "--set", "training.max_steps=" +
                         str(older_step + 2))
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert "skipped a damaged backup" in err and str(newest / TENSORS) in err, err
    record = json.loads((output / "run.json").read_text())
    assert record["status"] == "finished" and record["resumed_from"] == str(older)
    assert str(newest / TENSORS) in record["resume_skipped_backups"][0]
