"""Learning-rate schedules: each equals the reference implementation (diffusers' get_scheduler,
transformers' inverse-sqrt schedule) step for step, the run follows it, and a resumed run
continues it exactly."""
from __future__ import annotations

import pytest
import torch

from modules.config import Config, apply_overrides
from modules.config.problems import ConfigError
from modules.config.schema import LRScheduler
from modules.config.validate import validate
from modules.events import RecordingCallbacks
from modules.train.recipe.builders import build_lr_scheduler
from modules.train.recipe.schedules import SCHEDULES, ScheduleShape, lr_multiplier, schedule_curve
from modules.train.trainer import train
from tests.train.test_resume import run_json, stop_then_resume

TOTAL, WARMUP = 40, 6


def _reference(schedule: LRScheduler, optimizer, cycles: int, power: float):
    from diffusers.optimization import get_scheduler
    from transformers.optimization import get_inverse_sqrt_schedule
    if schedule == LRScheduler.INVERSE_SQRT:
        return get_inverse_sqrt_schedule(optimizer, num_warmup_steps=WARMUP)
    name = {LRScheduler.CONSTANT: "constant_with_warmup", LRScheduler.LINEAR: "linear",
            LRScheduler.COSINE: "cosine", LRScheduler.POLYNOMIAL: "polynomial",
            LRScheduler.COSINE_WITH_RESTARTS: "cosine_with_restarts"}[schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=WARMUP, num_training_steps=TOTAL,
                         num_cycles=cycles, power=power)


def _rates(scheduler, optimizer) -> list[float]:
    rates = []
    for _ in range(TOTAL + 3):  # a few past the end too
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("schedule", list(LRScheduler))
def test_each_schedule_equals_its_reference_step_for_step(schedule):
    cycles, power = 3, 2.0
    if schedule == LRScheduler.POLYNOMIAL:
        pytest.importorskip("diffusers")
    config = apply_overrides(Config(), [f"training.lr_scheduler={schedule.value}",
                                        f"training.lr_warmup_steps={WARMUP}",
                                        f"training.lr_cycles={cycles}",
                                        f"training.lr_power={power}",
                                        "training.learning_rate=0.5"])
    ours_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    ours = _rates(build_lr_scheduler(config, ours_opt, TOTAL), ours_opt)
    reference = _rates(_reference(schedule, ref_opt, cycles, power), ref_opt)
    if schedule == LRScheduler.POLYNOMIAL:
        # diffusers' polynomial decays to lr_end (1e-7 by default), ours to zero
        assert ours == pytest.approx(reference, abs=2e-7)
    else:
        assert ours == pytest.approx(reference, rel=1e-12, abs=1e-15)
    assert ours[0] == 0.0 and ours[WARMUP] == pytest.approx(0.5)  # the warm-up ramps from 0
    # the curve a front end draws is the same function
    curve = dict(schedule_curve(config, TOTAL, points=TOTAL))
    assert all(curve[s] == pytest.approx(ours[s]) for s in curve)


def test_the_shapes_do_what_their_descriptions_say():
    shape = ScheduleShape(total_steps=100, warmup_steps=0, cycles=4, power=2.0)
    restarts = [lr_multiplier(LRScheduler.COSINE_WITH_RESTARTS, s, shape) for s in range(100)]
    tops = [s for s in range(1, 100) if restarts[s] > restarts[s - 1] + 0.5]
    assert tops == [25, 50, 75]  # back to the base rate at each of the 3 restarts
    assert lr_multiplier(LRScheduler.POLYNOMIAL, 50, shape) == pytest.approx(0.25)
    assert lr_multiplier(LRScheduler.INVERSE_SQRT, 100, shape) > 0.99  # never reaches zero
    assert set(SCHEDULES) == set(LRScheduler)


def test_a_warmup_ratio_counts_from_the_runs_length_and_excludes_warmup_steps():
    config = apply_overrides(Config(), ["training.lr_warmup_ratio=0.25",
                                        "training.lr_scheduler=LINEAR"])
    curve = dict(schedule_curve(config, 40, points=40))
    assert curve[0] == 0.0 and curve[10] == pytest.approx(config.training.learning_rate)
    assert curve[5] == pytest.approx(config.training.learning_rate / 2)
    both = apply_overrides(Config(), ["training.lr_warmup_ratio=0.1",
                                      "training.lr_warmup_steps=5"])
    problems = [p for p in validate(both) if p.path == "training.lr_warmup_ratio"]
    assert len(problems) == 1 and "not both" in str(problems[0])
    with pytest.raises(ConfigError, match="training.lr_power"):
        apply_overrides(Config(), ["training.lr_power=0"])


def test_training_follows_the_schedule_and_a_resume_continues_it(tiny_config, tmp_path):
    settings = ("training.max_steps=6", "training.lr_scheduler=COSINE_WITH_RESTARTS",
                "training.lr_cycles=2", "training.lr_warmup_ratio=0.34",
                "training.learning_rate=1e-3")
    whole = tiny_config(*settings, f"output.dir={tmp_path / 'whole'}")
    events = RecordingCallbacks()
    train(whole, events)
    curve = dict(schedule_curve(whole, 6, points=6))
    # progress reports the rate for the next step
    assert [p.lr for p in events.progress] == pytest.approx([curve[s] for s in range(1, 7)])
    parts = tiny_config(*settings, f"output.dir={tmp_path / 'parts'}")
    stop_then_resume(parts, at=3)
    assert run_json(tmp_path / "parts")["losses"] == run_json(tmp_path / "whole")["losses"]


def test_no_curve_is_drawn_for_a_rate_that_will_not_be_used():
    """The curve a front end draws shows only what training uses: none under Adafactor's
    relative step (it ignores the rate), none for a warm-up longer than the run."""
    relative = apply_overrides(Config(), ["training.optimizer=ADAFACTOR_RELATIVE"])
    assert schedule_curve(relative, 100) == []
    too_long = apply_overrides(Config(), ["training.lr_warmup_steps=600"])
    assert schedule_curve(too_long, 25) == [] and schedule_curve(too_long, 600)
    assert schedule_curve(Config(), 0) == []
