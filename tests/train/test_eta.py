"""The ETA counts the sampling passes still to come (issue 33 item 8 e): the demo's ETA said
0:48 where 4:14 remained, because sampling every 50 steps was left out."""
from __future__ import annotations

from modules.config.schema import Config
from modules.train.eta import estimated_sample_seconds, eta_seconds, samples_still_due


def test_samples_still_due_counts_the_periodic_passes_and_the_final_one():
    # 400 steps, every 50: after step 1, the passes at 50, 100, ..., 400 (the last is final)
    assert samples_still_due(1, 400, 50, prompts=2) == 8
    assert samples_still_due(50, 400, 50, 2) == 8   # step 50's own pass comes after the event
    assert samples_still_due(51, 400, 50, 2) == 7
    assert samples_still_due(400, 400, 50, 2) == 1
    # 120 steps, every 50: 50, 100, then the final pass at 120
    assert samples_still_due(1, 120, 50, 2) == 3
    assert samples_still_due(101, 120, 50, 2) == 1
    assert samples_still_due(1, 120, 0, 2) == 1     # only the final pass
    assert samples_still_due(1, 400, 50, 0) == 0    # no prompts: no sampling


def test_eta_adds_the_sampling_time_to_the_steps_time():
    # The demo's case: 0.12 s steps, 8 passes of 26 s each still to come
    total, sampling = eta_seconds(remaining_steps=399, seconds_per_step=0.12, samples_due=8,
                                  seconds_per_sample=26.0)
    assert sampling == 208.0
    assert abs(total - (399 * 0.12 + 208.0)) < 1e-9
    assert eta_seconds(0, 0.12, 0, 26.0) == (0.0, 0.0)


def test_a_sampling_pass_is_estimated_from_its_forward_passes_before_one_ran():
    config = Config()
    config.sampling.prompts = ["a", "b"]
    config.sampling.steps = 20
    config.sampling.guidance_scale = 7.5                  # two forwards per denoising step
    config.training.batch_size = 4
    config.training.gradient_accumulation = 1
    # 2 prompts x 20 steps x 2 = 80 forwards; a step is 3 x 4 = 12 forwards' work
    assert abs(estimated_sample_seconds(config, 0.3) - 0.3 * 80 / 12) < 1e-9
    config.sampling.guidance_scale = 1.0
    assert abs(estimated_sample_seconds(config, 0.3) - 0.3 * 40 / 12) < 1e-9
