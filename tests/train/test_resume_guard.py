"""What a resume may not do: re-train a finished run over its final weights, let an older
segment replace a later final/, save the untrained base as "final" weights; and what it may:
resume with output.overwrite on (as the demo preset ships) and with another cache folder."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from modules.config.problems import ConfigError
from modules.events import RecordingCallbacks, TrainerCommands
from modules.models.tiny import builtin_identity, builtin_model_dir
from modules.data.shapes import builtin_dataset_identity, shapes_dataset_dir
from modules.train.state.backup_files import list_backups
from modules.train.state.resume_offer import SAVED_STEP_FILE, resume_offer, saved_step
from modules.train.trainer import train
from tests.train.test_resume import StopAt, copy_of, module_run, run_json

FOUR_STEPS = ("training.max_steps=4", "output.backup_every_steps=1")


@pytest.fixture(scope="module")
def finished_run(tempera_cache, tmp_path_factory) -> Path:
    """A run of FOUR_STEPS that finished (read only: tests go on from a copy)."""
    return module_run(tempera_cache, tmp_path_factory.mktemp("finished"), FOUR_STEPS)


@pytest.fixture(scope="module")
def stopped_run(tempera_cache, tmp_path_factory) -> Path:
    """A run of FOUR_STEPS stopped after step 2 (read only: tests resume a copy)."""
    return module_run(tempera_cache, tmp_path_factory.mktemp("stopped"), FOUR_STEPS, stop_at=2)


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `folder` with its modification time and bytes."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resuming_a_finished_run_is_refused_and_writes_nothing(tiny_config, finished_run):
    config = tiny_config(*FOUR_STEPS)
    output = copy_of(finished_run, config)
    assert run_json(output)["status"] == "finished"
    assert saved_step(output / "final") == 4
    before = snapshot(output)
    with pytest.raises(ConfigError) as err:
        train(tiny_config("training.max_steps=4", "output.backup_every_steps=1",
                          "training.resume_from=latest"))
    message = str(err.value)
    assert "finished at step 4" in message and "raise training.max_steps above 4" in message
    assert snapshot(output) == before
    assert not resume_offer(output, 4).can_resume and resume_offer(output, 5).can_resume
    assert "continues from its end (its backup at step 4)" in message


def test_a_raised_max_steps_continues_a_finished_run_to_the_new_maximum(tiny_config,
                                                                        finished_run):
    output = copy_of(finished_run, tiny_config(*FOUR_STEPS))
    newest = list_backups(output)[-1][0]
    result = train(tiny_config("training.max_steps=6", "output.backup_every_steps=1",
                               "training.resume_from=latest"))
    record = run_json(output)
    assert result.status == "finished" and result.steps == 6
    assert record["resumed_at_step"] == newest and len(record["losses"]) == 6
    assert saved_step(output / "final") == 6


def test_a_resumed_segment_that_stops_early_keeps_the_later_final_weights(tiny_config):
    """A run finished by a Tempera that wrote no backup at the end (final/ at step 6, newest
    backup step 4): its continue goes back to step 4, says so, and stopped at step 5 must not
    save step-5 weights over the step-6 final/."""
    import shutil
    config = tiny_config("training.max_steps=6", "output.backup_every_steps=2")
    train(config)
    output = Path(config.output.dir)
    assert list_backups(output)[-1][0] == 6  # the backup at the run's end...
    shutil.rmtree(list_backups(output)[-1][1])  # ...which an older Tempera did not write
    offer = resume_offer(output, 10)
    assert offer.rewinds and offer.more_steps == 4 and offer.steps_to_train == 6
    final_before = snapshot(output / "final")
    commands = TrainerCommands()
    callbacks = StopAt(commands, 5)
    continued = tiny_config("training.max_steps=10", "output.backup_every_steps=2",
                            "training.resume_from=latest")
    result = train(continued, callbacks, commands)
    assert result.status == "stopped" and result.steps == 5
    assert any("steps 5 to 6 are trained again" in s for s in callbacks.statuses)
    assert snapshot(output / "final") == final_before
    record = run_json(output)
    assert record["final_kept"]["final_step"] == 6 and record["final_kept"]["segment_step"] == 5
    assert any("final/ was kept" in s for s in callbacks.statuses)
    # the segment's own state is in its backup: resuming it reaches the new maximum
    assert list_backups(output)[-1][0] == 5
    assert train(continued).steps == 10 and saved_step(output / "final") == 10


def test_an_unreadable_step_marker_stops_the_save_instead_of_replacing_final(tiny_config):
    config = tiny_config("training.max_steps=4", "output.backup_every_steps=2")
    commands = TrainerCommands()
    train(config, StopAt(commands, 3), commands)
    output = Path(config.output.dir)
    (output / "final" / SAVED_STEP_FILE).write_text("{not json")
    with pytest.raises(Exception) as err:
        train(tiny_config("training.max_steps=4", "output.backup_every_steps=2",
                          "training.resume_from=latest"))
    assert SAVED_STEP_FILE in str(err.value)
    assert (output / "final" / SAVED_STEP_FILE).read_text() == "{not json"


def test_a_stop_before_the_first_step_saves_no_weights_and_says_nothing_to_resume(tiny_config):
    config = tiny_config("training.max_steps=4")
    commands = TrainerCommands()
    commands.request_stop()  # as a Stop pressed while the model loads
    callbacks = RecordingCallbacks()
    result = train(config, callbacks, commands)
    output = Path(config.output.dir)
    assert result.status == "stopped" and result.steps == 0
    assert not (output / "final").exists() and not list_backups(output)
    assert run_json(output)["final"].startswith("not saved")
    assert "nothing to resume" in callbacks.statuses[-1]
    assert "--resume latest" not in callbacks.statuses[-1]


def test_resume_with_overwrite_on_continues_and_says_overwrite_was_not_applied(tiny_config):
    config = tiny_config("training.max_steps=4", "output.backup_every_steps=1",
                         "output.overwrite=true")
    commands = TrainerCommands()
    train(config, StopAt(commands, 2), commands)
    output = Path(config.output.dir)
    callbacks = RecordingCallbacks()
    result = train(tiny_config("training.max_steps=4", "output.backup_every_steps=1",
                               "output.overwrite=true", "training.resume_from=latest"),
                   callbacks)
    record = run_json(output)
    assert result.steps == 4 and record["resumed_at_step"] == 2 and record["resume_count"] == 1
    assert len(record["losses"]) == 4  # the stopped segment's losses were not cleared
    assert record["overwrite"].startswith("not applied")
    assert any("output.overwrite is not applied" in s for s in callbacks.statuses)


def test_a_builtin_model_resumes_with_another_cache_folder(tiny_config, tmp_path, stopped_run):
    copy_of(stopped_run, tiny_config(*FOUR_STEPS))
    other_cache = tmp_path / "another-cache"
    result = train(tiny_config("training.max_steps=4", "output.backup_every_steps=1",
                               f"general.cache_dir={other_cache}",
                               "training.resume_from=latest"))
    record = run_json(result.output_dir)
    assert result.steps == 4 and record["resumed_at_step"] == 2
    assert (other_cache / "models").is_dir()  # it really loaded from the other cache
    assert record["model_identity"].startswith("builtin:tiny-sd15@")
    assert not any(line.startswith(("model.", "data.")) for line in record["resume_changed"])


def test_a_builtin_model_built_differently_is_still_refused(tiny_config, stopped_run):
    config = tiny_config(*FOUR_STEPS)
    copy_of(stopped_run, config)
    info_path = list_backups(Path(config.output.dir))[-1][1] / "backup.json"
    info = json.loads(info_path.read_text())
    info["config"]["model"]["path"] = str(Path(info["config"]["model"]["path"]).parent
                                          / "tiny-sd15-000000000000")  # an older builder
    info_path.write_text(json.dumps(info))
    with pytest.raises(ConfigError) as err:
        train(tiny_config("training.max_steps=4", "training.resume_from=latest"))
    assert "model.path: 'builtin:tiny-sd15@000000000000' -> 'builtin:tiny-sd15@" in str(err.value)


def test_builtin_identities_ignore_the_cache_folder(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    model = "builtin:tiny-sd15"
    assert builtin_identity(str(builtin_model_dir(model, a))) == \
        builtin_identity(str(builtin_model_dir(model, b))) is not None
    assert builtin_identity(str(builtin_model_dir(model, a))).startswith(model + "@")
    assert builtin_identity(str(builtin_model_dir("builtin:tiny-sdxl", a))) != \
        builtin_identity(str(builtin_model_dir(model, a)))
    assert builtin_identity(str(tmp_path / "models" / "my-model")) is None
    assert builtin_dataset_identity(str(shapes_dataset_dir(a))) == \
        builtin_dataset_identity(str(shapes_dataset_dir(b))) == "builtin:shapes@v1-48-64"
    assert builtin_dataset_identity(str(tmp_path / "datasets" / "cats")) is None
