"""Learning-rate schedules as a table of pure functions: the multiplier of the base learning
rate after `step` optimizer steps.

The same function drives training (through `torch.optim.lr_scheduler.LambdaLR`, whose state is
just the step count, so a resumed run continues the curve exactly) and the curve the GUI draws
next to the field before a run starts. The formulas are the ones diffusers' `get_scheduler` and
transformers' `get_inverse_sqrt_schedule` use (tests/train/test_schedules.py compares them
step by step), written here because the GUI must draw them without importing torch.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from modules.config.schema import Config, LRScheduler


@dataclass(frozen=True)
class ScheduleShape:
    """What a schedule needs besides the step: the run's length and the schedule's settings."""
    total_steps: int
    warmup_steps: int
    cycles: int = 1       # COSINE_WITH_RESTARTS: how many times the curve restarts from the top
    power: float = 1.0    # POLYNOMIAL: 1 is linear, 2 is quadratic decay to zero


def _warmup(step: int, shape: ScheduleShape) -> float | None:
    """The ramp from 0 over the warm-up steps (None once warm-up is over)."""
    if step < shape.warmup_steps:
        return step / max(1, shape.warmup_steps)
    return None


def _progress(step: int, shape: ScheduleShape) -> float:
    """How far the run is past its warm-up, from 0 to 1."""
    return (step - shape.warmup_steps) / max(1, shape.total_steps - shape.warmup_steps)


def _constant(step: int, shape: ScheduleShape) -> float:
    return 1.0


def _linear(step: int, shape: ScheduleShape) -> float:
    return max(0.0, 1.0 - _progress(step, shape))


def _cosine(step: int, shape: ScheduleShape) -> float:
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * _progress(step, shape))))


def _cosine_with_restarts(step: int, shape: ScheduleShape) -> float:
    progress = _progress(step, shape)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((shape.cycles * progress) % 1.0))))


def _polynomial(step: int, shape: ScheduleShape) -> float:
    return max(0.0, 1.0 - min(1.0, _progress(step, shape))) ** shape.power


def _inverse_sqrt(step: int, shape: ScheduleShape) -> float:
    # 1 at the end of warm-up, then 1/sqrt of the steps counted from a timescale of the
    # warm-up's length (10,000 without a warm-up), as transformers' inverse-sqrt schedule.
    timescale = shape.warmup_steps or 10_000
    return 1.0 / math.sqrt((step + timescale - shape.warmup_steps) / timescale)


# schedule -> (multiplier after warm-up, what it does in words: the docs and the GUI's tooltip)
SCHEDULES: dict[LRScheduler, tuple[Callable[[int, ScheduleShape], float], str]] = {
    LRScheduler.CONSTANT: (_constant, "the base rate throughout (after the warm-up, if any)"),
    LRScheduler.LINEAR: (_linear, "falls in a straight line to zero at the last step"),
    LRScheduler.COSINE: (_cosine, "falls along half a cosine to zero at the last step"),
    LRScheduler.COSINE_WITH_RESTARTS: (
        _cosine_with_restarts, "falls along half a cosine to zero, training.lr_cycles times, "
        "jumping back to the base rate at each restart"),
    LRScheduler.POLYNOMIAL: (_polynomial, "falls to zero as (1 - progress) ** training.lr_power"),
    LRScheduler.INVERSE_SQRT: (_inverse_sqrt, "falls as one over the square root of the step, "
                               "never reaching zero"),
}


def lr_multiplier(schedule: LRScheduler, step: int, shape: ScheduleShape) -> float:
    """The base learning rate's multiplier after `step` optimizer steps."""
    ramp = _warmup(step, shape)
    return ramp if ramp is not None else SCHEDULES[schedule][0](step, shape)


def schedule_shape(config: Config, total_steps: int) -> ScheduleShape:
    """The run's schedule settings; a warm-up ratio counts from the run's total steps."""
    t = config.training
    warmup = (round(t.lr_warmup_ratio * total_steps) if t.lr_warmup_ratio
              else t.lr_warmup_steps)
    return ScheduleShape(total_steps, warmup, t.lr_cycles, t.lr_power)


def schedule_curve(config: Config, total_steps: int, points: int = 200) -> list[tuple[int, float]]:
    """(step, learning rate) at up to `points` evenly spaced steps of the run, for a plot.

    Empty when no curve will be used: the optimizer sets its own step size (Adafactor's
    relative step ignores the rate and the schedule), the run has no step, or its warm-up is
    longer than the run (validation refuses that)."""
    from modules.config.optimizers import OPTIMIZERS
    shape = schedule_shape(config, total_steps)
    if (OPTIMIZERS[config.training.optimizer].own_step_size or total_steps < 1
            or shape.warmup_steps > total_steps):
        return []
    stride = max(1, total_steps // points)
    steps = sorted({*range(0, total_steps + 1, stride), shape.warmup_steps, total_steps})
    return [(s, config.training.learning_rate
             * lr_multiplier(config.training.lr_scheduler, s, shape))
            for s in steps if s <= total_steps]


def plot_schedules(path, total_steps: int = 1000, warmup_steps: int = 50) -> None:
    """docs/images/schedules.png: every schedule over one run, with a warm-up
    (`scripts/plot_schedules.py` writes it; the docs page shows it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 4.2), dpi=100)
    axes = figure.add_subplot()
    shape = ScheduleShape(total_steps, warmup_steps, cycles=3, power=2.0)
    steps = range(total_steps + 1)
    for schedule in LRScheduler:
        axes.plot(steps, [lr_multiplier(schedule, s, shape) for s in steps],
                  label=schedule.value)
    axes.set_xlabel(f"optimizer step (warm-up {warmup_steps} steps; lr_cycles 3, lr_power 2)")
    axes.set_ylabel("× training.learning_rate")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    FigureCanvasAgg(figure).print_png(str(path))
