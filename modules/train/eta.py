"""The time a run still needs: its remaining steps plus the sampling passes still to come.

Sampling is not a training step: it is timed apart (step times exclude it), so an ETA made of
steps alone said 0:48 where 4:14 remained on the demo, which samples every 50 steps. Pure
arithmetic, so every front end gets the same number through the progress event.
"""
from __future__ import annotations

from modules.config.schema import Config

# A training step is a forward and a backward pass (about three forwards' work) per image; a
# sampling pass runs a forward per denoising step and prompt, two with classifier-free guidance.
FORWARDS_PER_TRAINING_IMAGE = 3


def samples_still_due(step: int, total_steps: int, every_steps: int, prompts: int) -> int:
    """Sampling passes from `step` (just trained; its own periodic pass comes after the
    progress event) to the end, including the final pass a finished run makes when its last
    step is not a multiple of `every_steps`."""
    if prompts <= 0 or step > total_steps:
        return 0
    periodic = total_steps // every_steps - (step - 1) // every_steps if every_steps else 0
    final = 0 if every_steps and total_steps % every_steps == 0 else 1
    return max(periodic, 0) + final


def estimated_sample_seconds(config: Config, seconds_per_step: float) -> float:
    """A sampling pass's duration before one was measured, scaled from the step time by the
    forward passes each does."""
    s, t = config.sampling, config.training
    guidance = 2 if s.guidance_scale > 1 else 1
    sampling_forwards = len(s.prompts) * s.steps * guidance
    training_forwards = FORWARDS_PER_TRAINING_IMAGE * t.batch_size * t.gradient_accumulation
    return seconds_per_step * sampling_forwards / max(training_forwards, 1)


def eta_seconds(remaining_steps: int, seconds_per_step: float, samples_due: int,
                seconds_per_sample: float) -> tuple[float, float]:
    """(total ETA, its sampling part) in seconds."""
    sampling = samples_due * seconds_per_sample
    return max(remaining_steps, 0) * seconds_per_step + sampling, sampling
