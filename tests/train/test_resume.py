"""Backups and resume: a run stopped at step K and resumed is the run that was never stopped,
loss for loss and bit for bit; and the faults that end long runs leave a resumable state."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modules.config.problems import ConfigError
from modules.events import RecordingCallbacks, TrainerCommands
from modules.train.state.backup import flatten, unflatten
from modules.train.state.backup_files import list_backups
from modules.train.state.resume_offer import saved_step
from modules.train.trainer import TrainingError, train
from tests.train.test_bucketed_training import RESOLUTION, SQUARE, TALL, WIDE, make_images

STEPS = 4


class StopAt(RecordingCallbacks):
    """Asks the trainer to stop once step `at` is done (as the GUI's Stop or SIGTERM would)."""

    def __init__(self, commands: TrainerCommands, at: int) -> None:
        super().__init__()
        self.commands, self.at = commands, at

    def on_progress(self, progress) -> None:
        super().on_progress(progress)
        if progress.step == self.at:
            self.commands.request_stop()


def run_json(output: Path) -> dict:
    return json.loads((output / "run.json").read_text())


def final_tensors(output: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted((output / "final").rglob("*.safetensors")):
        for key, value in load_file(str(path)).items():
            tensors[f"{path.relative_to(output)}:{key}"] = value
    return tensors


def stop_then_resume(config, at: int):
    commands = TrainerCommands()
    first = train(config, StopAt(commands, at), commands)
    assert first.status == "stopped" and first.steps == at
    config.training.resume_from = "latest"
    return first, train(config, RecordingCallbacks())


def assert_resumes_bit_for_bit(tiny_config, tmp_path: Path, settings: tuple[str, ...],
                               at: int = 2) -> None:
    """A run stopped at step `at` and resumed equals the unbroken run of `settings`: the same
    losses, step by step, and the same final weights, bit for bit."""
    train(tiny_config(*settings, f"output.dir={tmp_path / 'whole'}"), RecordingCallbacks())
    stop_then_resume(tiny_config(*settings, f"output.dir={tmp_path / 'parts'}"), at=at)
    assert_resumed_as(tmp_path / "whole", tmp_path / "parts")


def assert_resumed_as(whole: Path, parts: Path) -> None:
    """The run in `parts`, resumed once, has the losses of the unbroken run in `whole`, step by
    step, and its final weights, bit for bit."""
    expected, got = run_json(whole), run_json(parts)
    assert got["losses"] == expected["losses"] and got["resume_count"] == 1
    want, have = final_tensors(whole), final_tensors(parts)
    assert want.keys() == have.keys() and want
    assert all(torch.equal(want[key], have[key]) for key in want)


CASES = {
    "lora-accumulation-ema": ("training.gradient_accumulation=2", "training.ema=true",
                              "components.text_encoder.train=true"),
    "fine-tune": ("training.method=FINE_TUNE", "training.learning_rate=1e-4"),
    "dataset-caption-dropout": ("data.caption_dropout=0.9", "data.datasets[0].caption_dropout=0.5"),
    # the embedding rows and their AdamW state; the old rows restored after every step
    "textual-inversion": ("training.method=TEXTUAL_INVERSION", "textual_inversion.vectors=2",
                          "textual_inversion.placeholder=<mychar>",
                          "textual_inversion.initializer=person", "output.formats=diffusers,kohya"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stopped_and_resumed_run_equals_the_uninterrupted_one(tiny_config, tmp_path, case):
    settings = (f"training.max_steps={STEPS}", "training.lr_scheduler=COSINE",
                "training.lr_warmup_steps=2", *CASES[case])
    whole = tiny_config(*settings, f"output.dir={tmp_path / 'whole'}")
    train(whole, RecordingCallbacks())
    parts = tiny_config(*settings, f"output.dir={tmp_path / 'parts'}")
    _, resumed = stop_then_resume(parts, at=STEPS // 2)

    expected, got = run_json(tmp_path / "whole"), run_json(tmp_path / "parts")
    assert got["losses"] == expected["losses"]  # every step, exactly
    assert len(got["losses"]) == STEPS and resumed.steps == STEPS
    want, have = final_tensors(tmp_path / "whole"), final_tensors(tmp_path / "parts")
    assert want.keys() == have.keys() and want
    for key in want:
        assert torch.equal(want[key], have[key]), key
    assert got["resume_count"] == 1 and got["resumed_at_step"] == STEPS // 2
    assert got["segments"][0]["status"] == "stopped"
    assert got["status"] == "finished" and "compile cache" in got["compile_state"]


def test_resume_with_aspect_buckets_continues_mid_epoch(tiny_config, tmp_path):
    images = make_images(tmp_path / "images", [WIDE, SQUARE, TALL] * 3)
    settings = ("data.aspect_buckets=true", f"data.resolution={RESOLUTION}", f"training.max_steps={STEPS}",
                f"data.datasets[0].path={images}", "training.batch_size=2")
    whole = tiny_config(*settings, f"output.dir={tmp_path / 'whole'}")
    train(whole, RecordingCallbacks())
    parts = tiny_config(*settings, f"output.dir={tmp_path / 'parts'}")
    stop_then_resume(parts, at=2)  # epoch 0 has 6 bucket batches: resumes inside it
    assert run_json(tmp_path / "parts")["losses"] == run_json(tmp_path / "whole")["losses"]


class LossesAtBackups(RecordingCallbacks):
    """Reads run.json's losses as each backup starts being written."""

    def __init__(self, output: Path) -> None:
        super().__init__()
        self.output, self.seen = output, []

    def on_status(self, text: str) -> None:
        super().on_status(text)
        if text.startswith("writing a backup at step "):
            step = int(text.removeprefix("writing a backup at step ").split()[0])
            self.seen.append((step, len(run_json(self.output)["losses"])))


def test_a_busy_output_folder_is_refused_then_backups_rotate_and_hold_no_pickle(tiny_config):
    """One run for three properties: a second run on a folder another run is writing into is
    refused; once that lock is released, the run takes it and its backups rotate; and run.json
    holds each backup's losses before the backup exists (a kill -9 right after its rename
    would otherwise resume with the losses a step short: the curve shifted)."""
    from modules.train.setup.output_lock import OutputLock
    config = tiny_config("training.max_steps=5", "output.backup_every_steps=1",
                         "output.keep_backups=2", "training.ema=true")
    lock = OutputLock(Path(config.output.dir)).acquire()
    try:
        with pytest.raises(ConfigError) as err:
            train(config)
        assert "another training is writing into it" in str(err.value)
    finally:
        lock.release()
    callbacks = LossesAtBackups(Path(config.output.dir))
    result = train(config, callbacks)  # a released (or dead owner's) lock is taken
    assert result.status == "finished"
    assert callbacks.seen == [(step, step) for step in range(1, 6)]
    found = list_backups(result.output_dir)
    # steps 1-4 by schedule and 5 at the run's end (a continue starts there), two kept
    assert [step for step, _ in found] == [4, 5]
    folder = found[-1][1]
    assert sorted(p.name for p in folder.iterdir()) == ["backup.json", "tensors.safetensors"]
    info = json.loads((folder / "backup.json").read_text())
    assert info["step"] == 5 and info["config"]["training"]["max_steps"] == 5
    assert info["reason"] == "finished"
    assert {"parameters", "optimizer", "lr_scheduler", "ema", "training", "random"} <= set(
        info["states"])
    with safe_open(str(folder / "tensors.safetensors"), framework="pt") as f:
        assert any(key.startswith("s.parameters.unet.") for key in f.keys())


def test_flatten_round_trips_optimizer_like_state():
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
             "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "name": "unet"}],
             "nan": float("inf")}
    tensors: dict = {}
    structure = json.loads(json.dumps(flatten(state, tensors, "s")))
    back = unflatten(structure, tensors)
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(back["state"][0]["exp_avg"], torch.ones(2))
    assert list(back["state"]) == [0]


# The run the resume tests below start from: 4 steps at a constant learning rate, a backup
# every step, stopped after step 2. Trained once for the module; each test resumes a copy.
STOPPED = ("training.max_steps=4", "output.backup_every_steps=1",
           "training.lr_scheduler=CONSTANT", "training.lr_warmup_steps=0")


def module_run(cache: Path, folder: Path, settings: tuple[str, ...],
               stop_at: int | None = None) -> Path:
    """The output folder of one run of the tiny model (tiny_config's settings, then
    `settings`) in `folder`, stopped after step `stop_at` if given: a module-scoped fixture's
    run that several tests copy (`copy_of`) and go on from."""
    from modules.config import Config, apply_overrides
    output = folder / "out"
    config = apply_overrides(Config(), [
        f"general.cache_dir={cache}", f"output.dir={output}", "data.resolution=64",
        "training.max_steps=3", "training.batch_size=2", "training.learning_rate=1e-3",
        "sampling.prompts=[]", "logging.tensorboard=false", *settings])
    commands = TrainerCommands()
    callbacks = RecordingCallbacks() if stop_at is None else StopAt(commands, stop_at)
    result = train(config, callbacks, commands)
    assert result.steps == (stop_at or config.training.max_steps)
    return output


@pytest.fixture(scope="module")
def stopped_run(tempera_cache, tmp_path_factory) -> Path:
    """The output folder of the STOPPED run (read only: tests resume a copy, `copy_of`)."""
    return module_run(tempera_cache, tmp_path_factory.mktemp("stopped"), STOPPED, stop_at=2)


def copy_of(run: Path, config) -> Path:
    """`run` copied into `config`'s output folder, as if that config's run had been stopped."""
    return Path(shutil.copytree(run, config.output.dir))


def test_resume_with_a_config_that_changes_the_math_is_refused_and_writes_nothing(tiny_config,
                                                                                  stopped_run):
    config = tiny_config(*STOPPED)
    copy_of(stopped_run, config)
    before = {p: p.stat().st_mtime_ns for p in Path(config.output.dir).rglob("*")}
    changed = tiny_config(*STOPPED, "training.lora_rank=4",
                          "training.optimizer=ADAMW_8BIT", "training.resume_from=latest")
    changed.training.optimizer = config.training.optimizer  # bitsandbytes may be absent
    with pytest.raises(ConfigError) as err:
        train(changed)
    assert "training.lora_rank: 16 -> 4" in str(err.value)
    assert {p: p.stat().st_mtime_ns for p in Path(config.output.dir).rglob("*")} == before


def test_resume_may_change_the_step_budget_and_records_it(tiny_config, stopped_run):
    copy_of(stopped_run, tiny_config(*STOPPED))
    longer = tiny_config(*STOPPED, "training.max_steps=5", "training.resume_from=latest")
    result = train(longer)
    record = run_json(result.output_dir)
    assert result.steps == 5 and len(record["losses"]) == 5
    assert record["resume_changed"] == ["training.max_steps: 4 -> 5"]


def test_resume_without_a_backup_is_a_clear_error(tiny_config):
    with pytest.raises(ConfigError) as err:
        train(tiny_config("training.resume_from=latest"))
    assert "training.resume_from" in str(err.value) and "no backup" in str(err.value)


def test_non_finite_loss_is_skipped_then_stops_with_no_nan_saved(tiny_config, monkeypatch):
    """From step 3 on the loss is NaN (as after a learning rate that exploded): those steps
    are skipped, two in a row stop the run, and every saved file holds finite weights."""
    import modules.train.recipe.recipe as recipe
    calls = {"n": 0}
    real = recipe.diffusion_loss

    def diverging(*args, **kwargs):
        calls["n"] += 1
        loss = real(*args, **kwargs)
        return loss * float("nan") if calls["n"] > 2 else loss

    monkeypatch.setattr(recipe, "diffusion_loss", diverging)
    config = tiny_config("training.max_steps=40", "training.max_bad_steps=2",
                         "output.save_every_steps=1", "output.backup_every_steps=1")
    with pytest.raises(TrainingError) as err:
        train(config)
    message = str(err.value)
    assert "2 steps in a row (up to step 4)" in message and "learning rate" in message
    output = Path(config.output.dir)
    record = run_json(output)
    assert record["status"] == "failed" and record["losses"][2:] == [None, None]
    assert [step for step, _ in list_backups(output)] == [1, 2]  # none after the bad steps
    saved = list(output.rglob("*.safetensors"))
    assert len(saved) >= 4
    for path in saved:
        for value in load_file(str(path)).values():
            if value.is_floating_point():
                assert torch.isfinite(value).all(), path


def test_disk_full_during_a_backup_keeps_the_previous_one(tiny_config, monkeypatch):
    import modules.train.state.backup as backup
    config = tiny_config("training.max_steps=4", "output.backup_every_steps=1")
    real = backup.atomic_write_dir

    def fill_disk_at_step_2(folder, write):
        if folder.name == "step-000002":
            raise OSError(28, "No space left on device")
        return real(folder, write)

    monkeypatch.setattr(backup, "atomic_write_dir", fill_disk_at_step_2)
    with pytest.raises(TrainingError) as err:
        train(config)
    assert "no space left" in str(err.value) and "MB free" in str(err.value)
    assert [step for step, _ in list_backups(Path(config.output.dir))] == [1]


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MB tmpfs (needs root and mount rights; skipped otherwise)."""
    import os
    import subprocess
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)],
            capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


class FillDiskBeforeBackup(RecordingCallbacks):
    """Fills the disk just before the step-2 backup is written."""

    def __init__(self, disk: Path) -> None:
        super().__init__()
        self.disk = disk

    def on_status(self, message: str) -> None:
        super().on_status(message)
        if message.startswith("writing a backup at step 2"):
            import shutil
            free = shutil.disk_usage(self.disk).free
            (self.disk / "filler").write_bytes(b"\0" * max(0, free - 4096))


def test_a_really_full_disk_during_a_backup_keeps_the_previous_one(tiny_config, small_disk):
    from modules.train.state.backup import load_states
    config = tiny_config(f"output.dir={small_disk / 'out'}", "training.max_steps=4",
                         "output.backup_every_steps=1")
    with pytest.raises(TrainingError) as err:
        train(config, FillDiskBeforeBackup(small_disk))
    message = str(err.value)
    assert "no space left on the disk of" in message and str(small_disk / "out") in message
    assert "MB needed" in message and "MB free" in message
    found = list_backups(small_disk / "out")
    assert [step for step, _ in found] == [1]
    info, states = load_states(found[0][1])  # the previous backup is whole and readable
    assert info["step"] == 1 and states["parameters"]


def test_a_new_learning_rate_applies_from_the_resumed_step(tiny_config, stopped_run):
    copy_of(stopped_run, tiny_config(*STOPPED))
    callbacks = RecordingCallbacks()
    result = train(tiny_config(*STOPPED, "training.learning_rate=5e-4",
                               "training.resume_from=latest"), callbacks)
    assert [p.lr for p in callbacks.progress] == [5e-4, 5e-4]
    assert "training.learning_rate: 0.001 -> 0.0005" in run_json(result.output_dir)[
        "resume_changed"]


def test_incomplete_backup_folders_are_never_picked(tmp_path):
    from modules.train.state.backup_files import find_backup
    root = tmp_path / "backups"
    (root / "step-000004").mkdir(parents=True)        # no backup.json: written half-way
    (root / ".step-000006.abc.tmp").mkdir()           # a write that was interrupted
    (root / "step-000002").mkdir()
    (root / "step-000002" / "backup.json").write_text("{}")
    (root / "step-000002" / "tensors.safetensors").write_bytes(b"")
    assert [step for step, _ in list_backups(tmp_path)] == [2]
    assert find_backup(tmp_path, "latest").name == "step-000002"


def test_overwrite_starts_clean_and_leaves_the_users_own_files(tiny_config):
    first = tiny_config("training.max_steps=2", "output.backup_every_steps=1",
                        "output.save_every_steps=1",
                        "sampling.prompts=[\"a red circle\"]", "sampling.every_steps=1",
                        "sampling.steps=2", "logging.tensorboard=true")
    train(first)
    output = Path(first.output.dir)
    (output / "notes.txt").write_text("mine")
    (output / "checkpoints" / "mine.txt").write_text("mine")
    assert len(list((output / "samples").iterdir())) == 2 and list_backups(output)
    second = tiny_config("training.max_steps=1", "output.overwrite=true",
                         "sampling.prompts=[\"a blue square\"]", "sampling.every_steps=0",
                         "sampling.steps=2", "logging.tensorboard=true")
    callbacks = RecordingCallbacks()
    train(second, callbacks)
    # only the new run's sample (its final one, at step 1): the old run's step 2 is gone
    assert [p.name for p in (output / "samples").iterdir()] == ["step-000001-0.png"]
    # no old backup for --resume latest to pick: the one left is the new run's, at its end
    # (a finished run keeps one there for Continue)
    assert [step for step, _ in list_backups(output)] == [1]
    assert len(list((output / "tensorboard").iterdir())) == 1  # one run's event file
    assert (output / "notes.txt").read_text() == "mine"
    # the old run's checkpoints are gone too (they would sit beside the new run's, outside
    # keep_checkpoints); the user's own file in checkpoints/ stays; final/ is the new run's
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == ["mine.txt"]
    assert saved_step(output / "final") == 1
    removed = "1 checkpoint(s) (step-000001)"  # the last step's weights are final/'s
    assert any("removed the previous run's samples/" in s and removed in s
               for s in callbacks.statuses)
    assert removed in run_json(output)["overwrite"]["removed"]
