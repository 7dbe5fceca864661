"""The ETA counts the sampling and validation passes still to come (issue 33 item 8 e): the
demo's ETA said 0:48 where 4:14 remained, because sampling every 50 steps was left out; a run
validating often likewise finished later than promised."""
from __future__ import annotations

from modules.config.schema import Config
from modules.config.prompts import sample_prompts
from modules.train.recipe.eta import (estimated_sample_seconds, estimated_validation_seconds,
                                      eta_seconds, samples_still_due, validations_still_due)


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
    total, sampling, validating = eta_seconds(remaining_steps=399, seconds_per_step=0.12,
                                              samples_due=8, seconds_per_sample=26.0)
    assert (sampling, validating) == (208.0, 0.0)
    assert abs(total - (399 * 0.12 + 208.0)) < 1e-9
    assert eta_seconds(0, 0.12, 0, 26.0) == (0.0, 0.0, 0.0)


def prompts_of(config: Config):
    return sample_prompts(config, read_file=False)[0]


def test_a_sampling_pass_is_estimated_from_its_forward_passes_before_one_ran():
    config = Config()
    config.sampling.prompts = ["a", "b"]
    config.sampling.steps = 20
    config.sampling.guidance_scale = 7.5                  # two forwards per denoising step
    config.training.batch_size = 4
    config.training.gradient_accumulation = 1
    # 2 prompts x 20 steps x 2 = 80 forwards; a step is 3 x 4 = 12 forwards' work
    assert abs(estimated_sample_seconds(config, prompts_of(config), 0.3) - 0.3 * 80 / 12) < 1e-9
    config.sampling.guidance_scale = 1.0
    assert abs(estimated_sample_seconds(config, prompts_of(config), 0.3) - 0.3 * 40 / 12) < 1e-9


def test_each_prompts_own_steps_guidance_and_size_count():
    config = Config()
    config.data.resolution = 512
    config.training.batch_size, config.training.gradient_accumulation = 4, 1
    config.sampling.steps, config.sampling.guidance_scale = 20, 7.5
    # 50 steps x 2; 20 steps x 1 (--l 1: no guidance); 20 x 2 at twice the pixels (1024x512)
    config.sampling.prompts = ["a --s 50", "b --l 1", "c --w 1024 --h 512"]
    forwards = 50 * 2 + 20 * 1 + 20 * 2 * 2
    assert abs(estimated_sample_seconds(config, prompts_of(config), 0.3)
               - 0.3 * forwards / 12) < 1e-9
    assert estimated_sample_seconds(config, [], 0.3) == 0.0


def test_validation_passes_still_due_and_their_time():
    # every 100 of 250 steps: 100, 200, and the pass at the end of the run (250)
    assert validations_still_due(1, 250, 100) == 3
    assert validations_still_due(100, 250, 100) == 3  # step 100's own pass follows the event
    assert validations_still_due(201, 250, 100) == 1
    assert validations_still_due(1, 200, 100) == 2    # the last step's pass is the end's one
    assert validations_still_due(1, 200, 0) == 0      # validation off: no pass at the end
    config = Config()
    config.training.batch_size, config.training.gradient_accumulation = 2, 3
    config.validation.timesteps = 4
    # 12 images x 4 timesteps = 48 forwards; a step is 3 x 2 x 3 = 18 forwards' work
    assert abs(estimated_validation_seconds(config, 12, 0.9) - 0.9 * 48 / 18) < 1e-9
    total, sampling, validating = eta_seconds(100, 0.5, 2, 10.0, validations_due=3,
                                              seconds_per_validation=4.0)
    assert (sampling, validating) == (20.0, 12.0)
    assert total == 100 * 0.5 + 20.0 + 12.0


def test_several_resolutions_scale_the_sampling_estimate_by_their_mean_pixels():
    config = Config()
    config.data.resolution, config.data.resolutions = 512, [512, 1024]
    config.training.batch_size, config.training.gradient_accumulation = 4, 1
    config.sampling.steps, config.sampling.guidance_scale = 20, 1.0
    config.sampling.prompts = ["a"]  # 512 x 512: 20 forwards of 512² against a mean of 2.5x
    expected = 0.3 * 20 * 512 ** 2 / ((512 ** 2 + 1024 ** 2) / 2) / 12
    assert abs(estimated_sample_seconds(config, prompts_of(config), 0.3) - expected) < 1e-9
