"""Optimizers: each trains, each resumes bit for bit (its state is in the backup), each that
cannot run here is refused before a run starts, and each logs what it reports."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from modules.config import Config, apply_overrides
from modules.config.optimizers import OPTIMIZERS
from modules.config.schema import Optimizer
from modules.config.validate import validate
from modules.events import RecordingCallbacks
from modules.train.trainer import train
from tests.train.test_resume import final_tensors, run_json, stop_then_resume

# Settings each optimizer is meant to be used with (and that validation accepts).
SETTINGS = {
    Optimizer.ADAMW: ["training.learning_rate=1e-3"],
    Optimizer.PRODIGY: ["training.learning_rate=1.0"],
    Optimizer.ADAFACTOR: ["training.learning_rate=1e-3"],
    Optimizer.ADAFACTOR_RELATIVE: ["training.learning_rate=1e-3"],
    Optimizer.LION: ["training.learning_rate=1e-4"],
    Optimizer.SCHEDULE_FREE_ADAMW: ["training.learning_rate=1e-3", "training.ema=false"],
    Optimizer.CAME: ["training.learning_rate=1e-3"],
}
RUNNABLE = [o for o in Optimizer if not OPTIMIZERS[o].needs_cuda]


def test_every_optimizer_has_a_row_and_cpu_settings():
    assert set(OPTIMIZERS) == set(Optimizer)
    assert set(SETTINGS) == set(RUNNABLE)


@pytest.mark.parametrize("optimizer", [o for o in RUNNABLE if o != Optimizer.ADAMW])
def test_each_optimizer_trains_and_resumes_bit_for_bit(tiny_config, tmp_path, optimizer):
    settings = ("training.max_steps=4", f"training.optimizer={optimizer.value}",
                "training.weight_decay=0.01", *SETTINGS[optimizer],
                # samples (and, for schedule-free AdamW, its eval()/train() swap) mid-run
                'sampling.prompts=["a red circle"]', "sampling.every_steps=1",
                "sampling.steps=1", "logging.tensorboard=true")
    whole = tiny_config(*settings, f"output.dir={tmp_path / 'whole'}")
    result = train(whole, RecordingCallbacks())
    losses = run_json(tmp_path / "whole")["losses"]
    assert result.steps == 4 and all(torch.isfinite(torch.tensor(losses)))
    if optimizer is Optimizer.PRODIGY:  # on the same run: Prodigy logs its step size
        assert_prodigy_logged_its_step_size(tmp_path / "whole", steps=4)
    parts = tiny_config(*settings, f"output.dir={tmp_path / 'parts'}")
    stop_then_resume(parts, at=2)
    assert run_json(tmp_path / "parts")["losses"] == losses
    want, have = final_tensors(tmp_path / "whole"), final_tensors(tmp_path / "parts")
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)


def assert_prodigy_logged_its_step_size(output, steps: int) -> None:
    """run.json and TensorBoard hold Prodigy's step size d, grown over the run."""
    logged = run_json(output)["optimizer"]
    assert logged["name"] == "PRODIGY" and logged["step"] == steps
    assert logged["d"] > 1e-6  # grown from its starting d0 of 1e-6
    events = list((output / "tensorboard").glob("events.*"))
    assert events and b"optimizer/d" in events[0].read_bytes()


def test_schedule_free_samples_and_saves_its_averaged_weights_and_trains_on(tiny_config,
                                                                           tmp_path):
    """Sampling and saving swap in schedule-free AdamW's averaged (eval) weights and give the
    live ones back bit for bit: a run that samples and checkpoints every step trains exactly
    as one that never does, and what it saves is not the live weights."""
    from safetensors.torch import load_file
    from modules.train.state.backup_files import list_backups

    base = ("training.max_steps=3", "training.optimizer=SCHEDULE_FREE_ADAMW",
            "training.method=FINE_TUNE", "training.learning_rate=1e-3")
    quiet = tiny_config(*base, f"output.dir={tmp_path / 'quiet'}")
    train(quiet, RecordingCallbacks())
    busy = tiny_config(*base, f"output.dir={tmp_path / 'busy'}", "output.save_every_steps=1",
                       'sampling.prompts=["a red circle"]', "sampling.every_steps=1",
                       "sampling.steps=1", "output.backup_every_steps=2")
    train(busy, RecordingCallbacks())
    assert run_json(tmp_path / "busy")["losses"] == run_json(tmp_path / "quiet")["losses"]
    assert final_tensors(tmp_path / "busy").keys() == final_tensors(tmp_path / "quiet").keys()
    saved = load_file(str(next((tmp_path / "busy" / "checkpoints" / "step-000002" / "unet")
                               .glob("*.safetensors"))))["conv_in.weight"]
    backup = dict(list_backups(tmp_path / "busy"))[2]  # step 2's: the live weights
    from safetensors import safe_open
    with safe_open(str(backup / "tensors.safetensors"), framework="pt") as f:
        key = next(k for k in f.keys() if k.startswith("s.parameters.unet.conv_in.weight#"))
        live = f.get_tensor(key)
    assert saved.shape == live.shape and not torch.equal(saved, live)


def test_what_cannot_run_here_is_refused_with_the_fix(monkeypatch):
    def config(*overrides):
        return apply_overrides(Config(), list(overrides))

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pytorch_optimizer" else real(name, *a))
    (problem,) = [p for p in validate(config("training.optimizer=LION"))
                  if p.path == "training.optimizer"]
    assert "pytorch-optimizer is not installed" in str(problem)
    assert "pip install pytorch-optimizer" in str(problem)
    monkeypatch.undo()
    (problem,) = [p for p in validate(config("training.optimizer=ADAMW_8BIT",
                                             "general.device=CPU"))
                  if p.path == "training.optimizer"]
    # the device first: installing bitsandbytes would only lead to this refusal
    assert problem.message == "AdamW 8-bit needs a CUDA GPU; use ADAMW"
    assert "pip install" not in str(problem)
    (problem,) = validate(config("training.optimizer=SCHEDULE_FREE_ADAMW",
                                 "training.lr_scheduler=COSINE"))
    assert problem.path == "training.lr_scheduler" and "CONSTANT" in problem.expected
    (problem,) = validate(config("training.optimizer=ADAFACTOR_RELATIVE",
                                 "training.lr_scheduler=LINEAR"))
    assert problem.path == "training.lr_scheduler"
    (problem,) = validate(config("training.optimizer=SCHEDULE_FREE_ADAMW", "training.ema=true"))
    assert problem.path == "training.ema"
    (problem,) = validate(config("training.optimizer=PRODIGY", "training.learning_rate=1e-4"))
    assert problem.path == "training.learning_rate" and "1.0 is usual" in str(problem)
    assert validate(config("training.optimizer=PRODIGY", "training.learning_rate=1.0")) == []
