"""Validation (issue 35 item 4) through the real trainer: the held-out images are not trained,
the score is fixed at fixed weights and moves with training, run.json / TensorBoard / the
callbacks name the best step, a resumed run continues the same history, and compiled training
graphs are never recompiled by it."""
from __future__ import annotations

import json

import pytest
import torch

from modules.config.problems import ConfigError
from modules.config.validate import validate as validate_config
from modules.events import RecordingCallbacks, TrainerCommands
from modules.train.state.backup_files import list_backups
from modules.train.recipe.distributed import Distributed
from modules.train.setup.inputs import check_inputs
from modules.train.setup.prepare import check_run, prepare_run
from modules.train.recipe.recipe import TrainingRecipe, forward_loss
from modules.train.state.training_state import TrainingState
from modules.train.trainer import train
from modules.train.validation.validation import (best_point, fixed_timesteps, score,
                                                 validation_pass)
from modules.train.validation.validation_set import Validator, build_validator
from tests.train.test_bucketed_training import RESOLUTION, SQUARE, TALL, WIDE, make_images
from tests.train.test_resume import StopAt, run_json

# 3 of the 48 shapes held out: a pass is 2 batches at 4 timesteps (a quarter, 12 images, made
# each pass cost as much as 8 training steps)
SPLIT = ("validation.every_steps=2", "validation.split_ratio=0.0625")


def problems_of(config) -> dict[str, str]:
    return {p.path: str(p) for p in validate_config(config)}


def test_validation_settings_are_refused_precisely(tiny_config, tmp_path):
    both = problems_of(tiny_config("validation.every_steps=5", "validation.split_ratio=0.1",
                                   f"validation.folder={tmp_path}"))
    assert "not both" in both["validation.folder"]
    nothing = problems_of(tiny_config("validation.every_steps=5"))
    assert "there are no validation images" in nothing["validation.every_steps"]
    never = problems_of(tiny_config("validation.split_ratio=0.2"))
    assert "never be scored (and never trained)" in never["validation.every_steps"]
    assert problems_of(tiny_config(*SPLIT)) == {}
    missing = check_inputs(tiny_config("validation.every_steps=5",
                                       f"validation.folder={tmp_path / 'nope'}"))
    assert [(p.path, p.message) for p in missing] == [("validation.folder", "no such folder")]


def test_a_split_that_leaves_a_side_empty_or_an_empty_folder_is_refused_at_start(tiny_config,
                                                                                 tmp_path):
    with pytest.raises(ConfigError) as none_held:
        check_run(tiny_config("validation.every_steps=2", "validation.split_ratio=0.01"),
                  RecordingCallbacks())
    message = str(none_held.value)
    assert "0.01 of the dataset's 48 training images holds out 0" in message
    assert "raise it to at least 0.02" in message
    one = make_images(tmp_path / "one", [(64, 64)])
    with pytest.raises(ConfigError, match="no training image would be left"):
        check_run(tiny_config("validation.every_steps=2", "validation.split_ratio=0.5",
                              f"data.datasets[0].path={one}"), RecordingCallbacks())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as empty:
        check_run(tiny_config("validation.every_steps=2", f"validation.folder={tmp_path / 'empty'}"),
                  RecordingCallbacks())
    assert empty.value.problems[0].path == "validation.folder"


def test_held_out_images_are_not_trained_and_the_score_is_fixed_until_training_moves_it(
        tiny_config):
    config = tiny_config(*SPLIT, "validation.every_steps=1", "training.max_steps=2",
                         "training.ema=true")
    callbacks = RecordingCallbacks()
    recipe = TrainingRecipe(prepare_run(config, callbacks), callbacks, Distributed(),
                            TrainerCommands())
    run = recipe.setup()
    try:
        trained = {str(item.path) for item in run.dataset.items}
        held = {str(item.path) for item in run.validator.images.items}
        assert len(held) == 3 and len(trained) == 45 and trained.isdisjoint(held)
        seen = {path for batch in run.loader_for_epoch(0) for path in batch["path"]}
        assert seen == trained  # what the loader hands the training step

        live = [p.detach().clone() for p in run.all_params()]
        first = score(run, forward_loss)[0]
        assert score(run, forward_loss)[0] == first  # fixed noise and timesteps: exactly
        fresh = build_validator(run.config, run.validator.images)  # batches built anew
        run.validator, kept = fresh, run.validator
        assert score(run, forward_loss)[0] == first
        run.validator = Validator(kept.images, 1, kept.timestep_count, kept.seed)
        assert score(run, forward_loss)[0] == pytest.approx(first, rel=1e-5)  # noise per image
        run.validator = kept
        assert all(torch.equal(a, b) for a, b in zip(live, run.all_params()))

        # Stop is asked before every forward (a batch at one timestep), as sampling asks
        # between denoising steps: a pass cut short scores what it did and records no score
        asked = iter(range(1_000))
        loss, done = score(run, forward_loss, lambda: next(asked) >= 3)
        forwards = len(run.validator.batches) * run.validator.timestep_count
        assert loss is None and (done.scored, done.total) == (3, forwards) and forwards > 3
        assert validation_pass(run, forward_loss, lambda: True) is None
        assert run.state.validation == []  # not a score
        assert run.record.data["validation"]["cut_short"] == {
            "step": 0, "forwards_scored": 0, "forwards": forwards}
        assert any("cut short by Stop (0 of" in s for s in callbacks.statuses)

        result = recipe.train()
    finally:
        recipe.close()
    history = result.record["validation"]["history"]
    assert [step for step, _ in history] == [1, 2]
    assert all(loss != first for _, loss in history)  # the weights moved, so did the score


def test_run_json_tensorboard_and_the_status_name_the_best_step(tiny_config):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    callbacks = RecordingCallbacks()
    result = train(tiny_config(*SPLIT, "training.max_steps=5", "logging.tensorboard=true"),
                   callbacks)
    section = json.loads((result.output_dir / "run.json").read_text())["validation"]
    history = section["history"]
    assert [step for step, _ in history] == [2, 4, 5]  # every 2 steps, and at the end
    best_step, best_loss = min(history, key=lambda point: point[1])
    assert section["best"] == {"step": best_step, "loss": best_loss}
    assert section["images"] == 3 and section["every_steps"] == 2
    assert section["timesteps"] == [125, 375, 625, 875]
    assert section["compile"].startswith("eager")
    assert result.record["dataset"]["images"] == 45

    assert [(s.step, s.loss) for s in callbacks.validations] == [tuple(p) for p in history]
    assert (callbacks.validations[-1].best_step, callbacks.validations[-1].best_loss) == (
        best_step, best_loss)
    last = [s for s in callbacks.statuses if s.startswith("validation loss")][-1]
    assert last == f"validation loss {history[-1][1]:.5f} at step 5 (best: step {best_step})"

    events = EventAccumulator(str(result.output_dir / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("validation/loss")]
    assert [s for s, _ in logged] == [2, 4, 5]
    assert [v for _, v in logged] == pytest.approx([loss for _, loss in history], rel=1e-6)


def test_a_resumed_run_keeps_the_history_and_continues_it_identically(tiny_config, tmp_path):
    """The uninterrupted run's progress reports count the validation passes still to come in
    the ETA, too."""
    settings = (*SPLIT, "training.max_steps=4", "training.ema=true")
    whole_config = tiny_config(*settings, f"output.dir={tmp_path / 'whole'}")
    progress = RecordingCallbacks()
    train(whole_config, progress)
    assert_the_eta_counts_the_validation_passes_still_to_come(whole_config, progress)
    parts = tiny_config(*settings, f"output.dir={tmp_path / 'parts'}")
    commands = TrainerCommands()
    first = train(parts, StopAt(commands, 3), commands)
    assert first.status == "stopped"
    backup = json.loads((list_backups(first.output_dir)[-1][1] / "backup.json").read_text())
    assert [p[0] for p in backup["states"]["training"]["validation"]] == [2]
    parts.training.resume_from = "latest"
    callbacks = RecordingCallbacks()
    train(parts, callbacks)

    whole, resumed = run_json(tmp_path / "whole"), run_json(tmp_path / "parts")
    assert resumed["losses"] == whole["losses"]
    assert resumed["validation"]["history"] == whole["validation"]["history"]  # exactly
    assert [p[0] for p in resumed["validation"]["history"]] == [2, 4]
    assert resumed["validation"]["best"] == whole["validation"]["best"]
    assert [s.step for s in callbacks.validations] == [4]  # step 2 came from the backup


def test_a_run_stopped_before_its_validation_resumes_with_fewer_timesteps(tiny_config):
    """Validation scores the run and does not train it: its settings may change on a resume
    (the owed pass uses the new ones, and the log says what changed), while the split, which
    takes images out of training, may not (turning validation off needs it at 0). Over 10 s:
    a stopped run and its resume, as only a real stop leaves a backup owing a validation pass."""
    commands = TrainerCommands()
    first = train(tiny_config(*SPLIT), StopAt(commands, 2), commands)  # before step 2's pass
    assert (first.status, first.steps) == ("stopped", 2)
    backup = json.loads((list_backups(first.output_dir)[-1][1] / "backup.json").read_text())
    assert backup["states"]["training"]["owed_passes"] == ["validation"]

    with pytest.raises(ConfigError) as refused:
        train(tiny_config(*SPLIT, "validation.every_steps=0", "validation.split_ratio=0",
                          "training.resume_from=latest"))
    assert "validation.split_ratio: 0.0625 -> 0.0" in str(refused.value)

    callbacks = RecordingCallbacks()
    train(tiny_config(*SPLIT, "validation.timesteps=2", "training.resume_from=latest"),
          callbacks)
    record = run_json(first.output_dir)
    assert record["resume_changed"] == ["validation.timesteps: 4 -> 2"]
    assert "changed since the backup: validation.timesteps: 4 -> 2" in callbacks.statuses
    assert "validating at step 2 (3 images at 2 timesteps)" in callbacks.statuses
    assert [step for step, _ in record["validation"]["history"]] == [2, 3]
    assert len(record["validation"]["timesteps"]) == 2


def test_a_backup_from_before_validation_loads_with_an_empty_history():
    state = TrainingState(generator=torch.Generator())
    saved = state.state_dict()
    del saved["validation"]
    state.validation = [[1, 0.5]]
    state.load_state_dict(saved)
    assert state.validation == []


def test_owed_passes_round_trip_and_an_older_backup_owes_none():
    state = TrainingState(generator=torch.Generator(), owed_passes=["sample", "validation"])
    saved = state.state_dict()
    loaded = TrainingState(generator=torch.Generator())
    loaded.load_state_dict(saved)
    assert loaded.owed_passes == ["sample", "validation"]
    del saved["owed_passes"]  # a backup written before a stop could owe passes
    loaded.load_state_dict(saved)
    assert loaded.owed_passes == []


@pytest.fixture
def fresh_dynamo():
    """No compiled frames from earlier tests: this test counts recompiles."""
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_training_is_not_recompiled_by_validation(tiny_config, tmp_path, fresh_dynamo):
    import torch._dynamo
    folder = make_images(tmp_path / "val", [(64, 64)] * 3)
    compiled = ("training.max_steps=5", "compile.backend=AOT_EAGER", "compile.denoiser=true")
    plain = train(tiny_config(*compiled, f"output.dir={tmp_path / 'plain'}"))
    torch._dynamo.reset()
    callbacks = RecordingCallbacks()
    validated = train(tiny_config(*compiled, "validation.every_steps=1",
                                  f"validation.folder={folder}",
                                  f"output.dir={tmp_path / 'validated'}"), callbacks)
    with_v, without = validated.record, plain.record
    assert len(with_v["validation"]["history"]) == 5
    assert with_v["compile"]["unet"]["compiled_code_ran"]
    # the same compiles as without validation, none after warm-up, and the same training
    assert with_v["compile"]["unet"]["recompiles"] == without["compile"]["unet"]["recompiles"]
    assert with_v["compile"]["unet"]["late_recompiles"] == 0
    assert with_v["batch_shapes"]["recompiles_after_first_pass"] == 0
    assert not [e for e in callbacks.compile_events if e.kind in ("recompile", "warning")]
    assert run_json(validated.output_dir)["losses"] == run_json(plain.output_dir)["losses"]


def test_aspect_bucketed_validation_images_are_batched_by_size(tiny_config, tmp_path):
    folder = make_images(tmp_path / "val", [WIDE, SQUARE, TALL, WIDE])
    config = tiny_config("validation.every_steps=1", f"validation.folder={folder}",
                         "data.aspect_buckets=true", f"data.resolution={RESOLUTION}",
                         "validation.batch_size=4")
    callbacks = RecordingCallbacks()
    recipe = TrainingRecipe(prepare_run(config, callbacks), callbacks, Distributed(),
                            TrainerCommands())
    run = recipe.setup()
    try:
        loss = score(run, forward_loss)[0]
        shapes = sorted(tuple(batch["latents"].shape) for batch, _ in run.validator.batches)
    finally:
        recipe.close()
    assert loss is not None and len(shapes) == 3  # wide (2 images), square, tall
    assert sorted(s[0] for s in shapes) == [1, 1, 2]


def test_fixed_timesteps_and_the_best_point():
    assert fixed_timesteps(4, 1000) == [125, 375, 625, 875]
    assert fixed_timesteps(1, 1000) == [500]
    assert fixed_timesteps(2, 1000, low=200, high=600) == [300, 500]  # loss.min/max_timestep
    assert best_point([[2, 0.5], [4, None], [6, 0.4], [8, 0.4]]) == (6, 0.4)
    assert best_point([[2, None]]) == (None, None)


def assert_the_eta_counts_the_validation_passes_still_to_come(config, callbacks) -> None:
    """`config` ran 4 steps validating every 2: each progress report's ETA holds the passes
    still to come."""
    from modules.train.recipe.eta import estimated_validation_seconds
    first, *_, last = callbacks.progress
    # before any pass: the passes at steps 2 and 4, each estimated from the step time
    estimate = estimated_validation_seconds(config, 3, first.seconds_per_step)
    assert first.validation_eta_seconds == pytest.approx(2 * estimate) and estimate > 0
    assert last.step == 4 and last.validation_eta_seconds > 0  # step 4's pass is still to come
    for p in callbacks.progress:
        steps_part = (p.max_steps - p.step) * p.seconds_per_step
        assert p.eta_seconds == pytest.approx(steps_part + p.sampling_eta_seconds
                                              + p.validation_eta_seconds)
