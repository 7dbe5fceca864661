"""A damaged backup never strands the user: backups are checked when written (no NaN or inf is
ever written) and when read (both files parse, every tensor named is there and finite);
"latest" passes over a damaged backup to the newest intact one and says so, a damaged backup
named explicitly is refused before anything is written, and nothing already saved is touched.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from modules.config.problems import ConfigError
from modules.events import RecordingCallbacks, TrainerCommands
from modules.train.state.backup import BackupError, resume_point, verify_backup
from modules.train.state.backup_files import TENSORS, list_backups
from modules.train.trainer import train
from tests.train.test_resume import StopAt, run_json


def fingerprint(folder: Path) -> dict[str, str]:
    """Every file under `folder` by its content hash: what "nothing was touched" compares."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def truncate(folder: Path) -> None:
    """What a disk error or a copy cut short leaves: the tensors file's first half."""
    path = folder / TENSORS
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def poison(folder: Path) -> str:
    """Put a NaN into the first floating-point tensor of a backup; return its key."""
    path = folder / TENSORS
    tensors = load_file(str(path))
    key = next(k for k, t in sorted(tensors.items()) if t.is_floating_point() and t.numel())
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, str(path))
    return key


@pytest.fixture
def stopped_run(tiny_config):
    """A run stopped at step 3 with backups of steps 2 and 3 (keep_backups=2)."""
    def make():
        settings = ("training.max_steps=5", "output.backup_every_steps=1",
                    "output.keep_backups=2")
        commands = TrainerCommands()
        train(tiny_config(*settings), StopAt(commands, 3), commands)
        return tiny_config(*settings, "training.resume_from=latest")
    return make


def test_latest_passes_over_a_truncated_backup_names_it_and_finishes(stopped_run):
    config = stopped_run()
    output = Path(config.output.dir)
    (_, older), (_, newest) = list_backups(output)
    truncate(newest)
    callbacks = RecordingCallbacks()
    result = train(config, callbacks)
    assert result.status == "finished" and result.steps == 5
    skipped = [s for s in callbacks.statuses if s.startswith("skipped a damaged backup")]
    assert len(skipped) == 1 and str(newest / TENSORS) in skipped[0], callbacks.statuses
    record = run_json(output)
    assert record["resumed_from"] == str(older) and record["resumed_at_step"] == 2
    assert len(record["resume_skipped_backups"]) == 1
    assert str(newest / TENSORS) in record["resume_skipped_backups"][0]


def test_latest_passes_over_a_backup_holding_nan(stopped_run):
    config = stopped_run()
    output = Path(config.output.dir)
    (_, older), (_, newest) = list_backups(output)
    key = poison(newest)
    written_by = json.loads((older / "backup.json").read_text())["config"]
    point = resume_point(output, "latest", written_by)
    assert point.folder == older and point.step == 2
    assert "NaN or inf" in point.skipped[0] and key in point.skipped[0]


def test_a_damaged_backup_named_explicitly_is_refused_and_nothing_is_written(stopped_run):
    config = stopped_run()
    output = Path(config.output.dir)
    _, newest = list_backups(output)[-1]
    truncate(newest)
    before = fingerprint(output)
    config.training.resume_from = str(newest)
    with pytest.raises(ConfigError) as err:
        train(config, RecordingCallbacks())
    message = str(err.value)
    assert "training.resume_from" in message and str(newest / TENSORS) in message
    assert "cannot be read" in message
    assert fingerprint(output) == before  # run.json still says stopped; backups untouched
    assert run_json(output)["status"] == "stopped"


def test_no_intact_backup_at_all_is_refused_naming_each(stopped_run):
    config = stopped_run()
    output = Path(config.output.dir)
    for _, folder in list_backups(output):
        poison(folder)
    before = fingerprint(output)
    with pytest.raises(ConfigError) as err:
        train(config, RecordingCallbacks())
    message = str(err.value)
    assert "no intact backup" in message
    assert all(str(folder / TENSORS) in message for _, folder in list_backups(output))
    assert fingerprint(output) == before


def test_reading_checks_every_named_tensor_is_present(stopped_run):
    config = stopped_run()
    _, newest = list_backups(Path(config.output.dir))[-1]
    assert verify_backup(newest)["step"] == 3  # intact as written
    path = newest / TENSORS
    tensors = load_file(str(path))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(path))
    with pytest.raises(BackupError) as err:
        verify_backup(newest)
    assert str(path) in str(err.value) and "missing" in str(err.value)
    assert dropped in str(err.value)


class PoisonMomentsAt(StopAt):
    """At step `at`, put a NaN into the optimizer's moments (as a broken kernel or a bit flip
    might) and ask to stop: the stop's backup would hold that NaN."""

    def __init__(self, commands, at: int, optimizer_of) -> None:
        super().__init__(commands, at)
        self.optimizer_of = optimizer_of

    def on_progress(self, progress) -> None:
        if progress.step == self.at:
            optimizer = self.optimizer_of()
            state = next(iter(optimizer.state.values()))
            state["exp_avg"].view(-1)[0] = float("nan")
        super().on_progress(progress)


def test_a_backup_holding_nan_is_never_written_and_the_previous_one_is_kept(tiny_config,
                                                                           monkeypatch):
    from modules.train.recipe.recipe import TrainingRecipe
    built = {}
    real_setup = TrainingRecipe.setup

    def setup(recipe):  # keeps a handle on the run's optimizer for the poison
        run = real_setup(recipe)
        built["run"] = run
        return run

    monkeypatch.setattr(TrainingRecipe, "setup", setup)
    config = tiny_config("training.max_steps=5", "output.backup_every_steps=1")
    output = Path(config.output.dir)
    commands = TrainerCommands()
    callbacks = PoisonMomentsAt(commands, 2, lambda: built["run"].optimizer)
    # step 1 writes its backup; at step 2 the moments hold a NaN: its backup is refused
    original_backup = None

    def keep_first(message: str) -> None:
        nonlocal original_backup
        if message.startswith("writing a backup at step 2"):
            original_backup = fingerprint(output / "backups")
    callbacks.on_status = lambda message: (RecordingCallbacks.on_status(callbacks, message),
                                           keep_first(message))
    result = train(config, callbacks, commands)
    assert result.status == "stopped"
    assert [step for step, _ in list_backups(output)] == [1]
    assert fingerprint(output / "backups") == original_backup  # step 1's, byte for byte
    refused = [s for s in callbacks.statuses if s.startswith("backup refused")]
    assert len(refused) == 1 and "NaN or inf" in refused[0] and "step 1 is kept" in refused[0]
    record = run_json(output)
    assert [r["step"] for r in record["backups_refused"]] == [2]
    assert "exp_avg" in record["backups_refused"][0]["why"]
    # --resume latest continues from the intact backup
    resumed = train(tiny_config("training.max_steps=5", "output.backup_every_steps=1",
                                "training.resume_from=latest"), RecordingCallbacks())
    assert resumed.status == "finished" and run_json(output)["resumed_at_step"] == 1


def test_a_backup_from_a_newer_tempera_is_refused_with_that_reason(stopped_run):
    # The backup's config is migrated once, and what the migration finds is not dropped.
    config = stopped_run()
    output = Path(config.output.dir)
    _, newest = list_backups(output)[-1]
    info_path = newest / "backup.json"
    info = json.loads(info_path.read_text())
    written_by = dict(info["config"])
    info["config"]["config_version"] += 1
    info_path.write_text(json.dumps(info))
    with pytest.raises(BackupError, match="newer Tempera"):
        resume_point(output, str(newest), written_by)
