"""The time a run still needs: its remaining steps plus the sampling and validation passes
still to come.

Neither sampling nor validation is a training step: each is timed apart (step times exclude
them), so an ETA made of steps alone said 0:48 where 4:14 remained on the demo, which samples
every 50 steps, and a run validating often finished later than promised. Pure arithmetic, so
every front end gets the same number through the progress event.
"""
from __future__ import annotations

from collections.abc import Sequence

from modules.config.data import trained_resolutions
from modules.config.prompts import SamplePrompt
from modules.config.schema import Config

# A training step is a forward and a backward pass (about three forwards' work) per image; a
# sampling pass runs a forward per denoising step and prompt, two with classifier-free
# guidance; a validation pass one forward per image and timestep, with no backward.
FORWARDS_PER_TRAINING_IMAGE = 3


def passes_still_due(step: int, total_steps: int, every_steps: int) -> int:
    """Passes made every `every_steps` steps from `step` (just trained; its own periodic pass
    comes after the progress event) to the end, including the one a finished run makes at its
    last step when that is not a multiple of `every_steps`."""
    if step > total_steps:
        return 0
    periodic = total_steps // every_steps - (step - 1) // every_steps if every_steps else 0
    final = 0 if every_steps and total_steps % every_steps == 0 else 1
    return max(periodic, 0) + final


def samples_still_due(step: int, total_steps: int, every_steps: int, prompts: int) -> int:
    """Sampling passes still to come (`passes_still_due`); none without prompts."""
    return passes_still_due(step, total_steps, every_steps) if prompts > 0 else 0


def validations_still_due(step: int, total_steps: int, every_steps: int) -> int:
    """Validation passes still to come (`passes_still_due`); none with validation off
    (`every_steps` 0: unlike sampling, an end-of-run pass needs a schedule)."""
    return passes_still_due(step, total_steps, every_steps) if every_steps > 0 else 0


def training_forwards(config: Config) -> int:
    """A training step's work in image forwards (batch × accumulation × forward+backward)."""
    t = config.training
    return max(FORWARDS_PER_TRAINING_IMAGE * t.batch_size * t.gradient_accumulation, 1)


def estimated_sample_seconds(config: Config, prompts: Sequence[SamplePrompt],
                             seconds_per_step: float) -> float:
    """A sampling pass's duration before one was measured, scaled from the step time by the
    forward passes each does: each prompt's own steps (`--s`) and guidance (`--l`), and its
    size (`--w`/`--h`) against the training resolution (a forward's work grows with the
    pixels it denoises; with several resolutions the step time is their mix, taken as the
    mean of their pixel counts)."""
    resolutions = trained_resolutions(config.data)
    trained_pixels = sum(r * r for r in resolutions) / len(resolutions)
    sampling_forwards = sum(p.steps * (2 if p.guidance_scale > 1 else 1)
                            * p.width * p.height / trained_pixels for p in prompts)
    return seconds_per_step * sampling_forwards / training_forwards(config)


def estimated_validation_seconds(config: Config, images: int, seconds_per_step: float) -> float:
    """A validation pass's duration before one was measured: a forward per image and fixed
    timestep, scaled from the step time (eager forwards are slower than compiled ones, so this
    is a floor until a pass is measured)."""
    forwards = images * config.validation.timesteps
    return seconds_per_step * forwards / training_forwards(config)


def eta_seconds(remaining_steps: int, seconds_per_step: float, samples_due: int,
                seconds_per_sample: float, validations_due: int = 0,
                seconds_per_validation: float = 0.0) -> tuple[float, float, float]:
    """(total ETA, its sampling part, its validation part) in seconds."""
    sampling = samples_due * seconds_per_sample
    validating = validations_due * seconds_per_validation
    return (max(remaining_steps, 0) * seconds_per_step + sampling + validating, sampling,
            validating)
