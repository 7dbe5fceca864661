"""validation.save_best (train/outputs/best_weights.py): best/ holds the weights of the step with the
lowest validation loss, a worse score never replaces it (also after a resume), it survives
output.keep_checkpoints, an interrupted save leaves it intact, and the setting is refused
without validation and greyed while validation is off.

The validation scores are scripted (a function of the step, so a resumed run sees the same
ones) to make which step is the best certain; the weights are the real trainer's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modules.config.field_rules import unused_fields
from modules.config.validate import validate as validate_config
from modules.events import RecordingCallbacks, TrainerCommands
from modules.train.validation import validation
from modules.train.outputs.best_weights import latest_pass_improves
from modules.train.state.resume_offer import saved_step
from modules.train.trainer import TrainingError, train
from tests.train.test_resume import StopAt, run_json

SETTINGS = ("validation.every_steps=1", "validation.split_ratio=0.25", "validation.save_best=true",
            "training.max_steps=5", "output.save_every_steps=1",
            'output.formats=["DIFFUSERS", "KOHYA"]')


@pytest.fixture
def scripted_scores(monkeypatch):
    """Replace the validation score with `scores[step]` (the weights are still real)."""
    scores: dict[int, float | None] = {}
    monkeypatch.setattr(validation, "score", lambda run, loss_fn: scores[run.step])
    return scores


def weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.rglob("*.safetensors")):
        for key, value in load_file(str(path)).items():
            tensors[f"{path.relative_to(folder)}:{key}"] = value
    return tensors


def assert_same_weights(a: Path, b: Path) -> None:
    left, right = weights(a), weights(b)
    assert left and left.keys() == right.keys()
    for key in left:
        assert torch.equal(left[key], right[key]), key


def test_save_best_is_refused_without_validation_and_greyed_while_off(tiny_config):
    problems = {p.path: str(p) for p in validate_config(tiny_config("validation.save_best=true"))}
    assert list(problems) == ["validation.save_best"]
    assert "false while validation.every_steps is 0" in problems["validation.save_best"]
    assert "set validation.every_steps" in problems["validation.save_best"]
    assert validate_config(tiny_config(*SETTINGS)) == []
    assert unused_fields(tiny_config())["validation.save_best"] == (
        "validation is off (validation.every_steps is 0)")
    # on without validation: left editable, so the refused value can be turned off
    assert "validation.save_best" not in unused_fields(tiny_config("validation.save_best=true"))
    assert "validation.save_best" not in unused_fields(tiny_config(*SETTINGS))


def test_only_a_strictly_lower_finite_loss_improves():
    assert latest_pass_improves([[1, 0.5]])
    assert latest_pass_improves([[1, None], [2, 0.9]])
    assert latest_pass_improves([[1, 0.5], [2, 0.8], [3, 0.4]])
    assert not latest_pass_improves([[1, 0.5], [2, 0.5]])       # a tie keeps the earlier step
    assert not latest_pass_improves([[1, 0.5], [2, 0.6]])
    assert not latest_pass_improves([[1, 0.5], [2, None]])
    assert not latest_pass_improves([])


def test_best_holds_the_best_steps_weights_and_survives_keep_checkpoints(tiny_config, tmp_path,
                                                                        scripted_scores):
    scripted_scores.update({1: 1.0, 2: 0.5, 3: 0.8, 4: 0.9, 5: 0.7})
    callbacks = RecordingCallbacks()
    every = train(tiny_config(*SETTINGS, f"output.dir={tmp_path / 'all'}"), callbacks)
    best = every.output_dir / "best"
    assert saved_step(best) == 2
    assert_same_weights(best, every.output_dir / "checkpoints" / "step-000002")
    assert (best / "lora_kohya.safetensors").is_file()  # every output.formats, as a checkpoint
    assert run_json(every.output_dir)["best_weights"] == {"folder": "best", "step": 2,
                                                          "loss": 0.5}
    assert [s for s in callbacks.statuses if s.startswith("best/")] == [
        "best/ now holds the weights of step 1 (validation loss 1.00000)",
        "best/ now holds the weights of step 2 (validation loss 0.50000)"]

    kept = train(tiny_config(*SETTINGS, "output.keep_checkpoints=1",
                             f"output.dir={tmp_path / 'kept'}"))
    assert [p.name for p in (kept.output_dir / "checkpoints").iterdir()] == ["step-000004"]
    assert saved_step(kept.output_dir / "best") == 2
    assert_same_weights(kept.output_dir / "best", best)


def test_a_resumed_run_knows_the_best_so_far(tiny_config, tmp_path, scripted_scores):
    scripted_scores.update({1: 1.0, 2: 0.5, 3: 0.8, 4: 0.9, 5: 0.3})
    config = tiny_config(*SETTINGS, f"output.dir={tmp_path / 'parts'}")
    commands = TrainerCommands()
    assert train(config, StopAt(commands, 3), commands).status == "stopped"
    output = Path(config.output.dir)
    assert saved_step(output / "best") == 2
    config.training.resume_from = "latest"
    callbacks = RecordingCallbacks()
    train(config, callbacks)
    # step 4's 0.9 is worse than step 2's 0.5 (from the backup's history): only step 5 saved
    assert [s for s in callbacks.statuses if s.startswith("best/")] == [
        "best/ now holds the weights of step 5 (validation loss 0.30000)"]
    assert saved_step(output / "best") == 5
    assert_same_weights(output / "best", output / "final")
    assert run_json(output)["best_weights"]["step"] == 5


def test_an_interrupted_save_leaves_the_previous_best(tiny_config, tmp_path, scripted_scores,
                                                      monkeypatch):
    from modules.train.outputs import saving as weights_module
    scripted_scores.update({1: 1.0, 2: 0.5})
    real = weights_module.write_lora_diffusers
    calls = []

    def fails_the_second_time(bundle, config, folder):
        calls.append(folder)
        if len(calls) == 2:
            raise OSError("the machine went away")
        return real(bundle, config, folder)

    monkeypatch.setattr(weights_module, "write_lora_diffusers", fails_the_second_time)
    config = tiny_config(*SETTINGS, "output.save_every_steps=0",
                         f"output.dir={tmp_path / 'out'}")
    with pytest.raises(TrainingError, match="the machine went away"):
        train(config)
    output = Path(config.output.dir)
    assert calls[1].name.startswith(".best.")  # the second save was best/'s, into a temp folder
    assert saved_step(output / "best") == 1
    assert weights(output / "best")
    assert sorted(p.name for p in output.iterdir() if p.name.startswith(".best")) == []
    assert json.loads((output / "run.json").read_text())["best_weights"]["step"] == 1
