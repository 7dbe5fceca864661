"""Flow matching as an objective: the noisy input and velocity target, the timestep draws
(uniform or logit-normal, then the fixed or resolution-dependent shift) checked against
diffusers' own FlowMatchEulerDiscreteScheduler and ZImagePipeline, and the options of one
objective refused for a family trained on the other, with the reason."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from modules.config import Config, apply_overrides, validate
from modules.config.loss import LossConfig, TimestepSampling
from modules.models.families import family_of
from modules.models.families.flow import (FLOW_MATCHING, calculate_mu, flow_timesteps, shifted,
                                          unit_draw)
from modules.model_types import MODEL_TYPES
from modules.train.recipe.loss_checks import family_problems


class Bundle:  # what the objective reads of a bundle: its scheduler
    def __init__(self, **config):
        from diffusers import FlowMatchEulerDiscreteScheduler
        self.noise_scheduler = FlowMatchEulerDiscreteScheduler(**config)


def test_the_noisy_input_is_on_the_line_from_data_to_noise_and_the_target_its_velocity():
    latents, noise = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4)
    noisy, target = FLOW_MATCHING.noisy_and_target(Bundle(), latents, noise,
                                                    torch.tensor([0.0, 250.0]))
    assert torch.equal(noisy[0], latents[0])
    torch.testing.assert_close(noisy[1], 0.75 * latents[1] + 0.25 * noise[1])
    assert torch.equal(target, noise - latents)


@pytest.mark.parametrize("shift", [1.0, 3.0, 6.0])
def test_the_fixed_shift_is_the_schedulers(shift):
    from diffusers import FlowMatchEulerDiscreteScheduler
    sigmas = [0.9, 0.6, 0.3, 0.1]
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(sigmas=sigmas)
    ours = shifted(torch.tensor(sigmas, dtype=torch.float64), shift, None)
    torch.testing.assert_close(ours.float(), scheduler.sigmas[:-1])


@pytest.mark.parametrize("latent", [(64, 64), (128, 96)])  # 512 px and 1024 x 768 px
def test_the_resolution_dependent_shift_is_zimage_pipelines(latent):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    tokens = (latent[0] // 2) * (latent[1] // 2)  # as ZImagePipeline counts image_seq_len
    mu = calculate_shift(tokens, scheduler.config.get("base_image_seq_len", 256),
                         scheduler.config.get("max_image_seq_len", 4096),
                         scheduler.config.get("base_shift", 0.5),
                         scheduler.config.get("max_shift", 1.15))
    assert calculate_mu(tokens, scheduler.config) == pytest.approx(mu)
    sigmas = [0.9, 0.5, 0.2]
    scheduler.set_timesteps(sigmas=sigmas, mu=mu)
    ours = shifted(torch.tensor(sigmas, dtype=torch.float64), None, mu)
    torch.testing.assert_close(ours.float(), scheduler.sigmas[:-1])
    loss = LossConfig(dynamic_shift=True)
    normal = torch.randn(4, generator=torch.Generator().manual_seed(0))
    expected = shifted(unit_draw(normal, loss), None, mu) * 1000
    torch.testing.assert_close(flow_timesteps(Bundle(use_dynamic_shifting=True), normal, loss,
                                              latent), expected.float())


def test_uniform_and_logit_normal_draws():
    normal = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    uniform = unit_draw(normal, LossConfig())
    assert 0 <= uniform.min() and uniform.max() < 1
    assert abs(float((uniform < 0.25).double().mean()) - 0.25) < 0.02  # its normal CDF
    loss = LossConfig(timestep_sampling=TimestepSampling.LOGIT_NORMAL, logit_mean=0.5,
                      logit_std=0.8)
    torch.testing.assert_close(unit_draw(normal, loss), torch.sigmoid(0.5 + 0.8 * normal.double()))
    narrow = dataclasses.replace(LossConfig(), min_timestep=200, max_timestep=400)
    assert 0.2 <= float(unit_draw(normal, narrow).min()) < float(unit_draw(normal, narrow).max()) < 0.4
    # no shift given: the model scheduler's own (Z-Image Base's 6)
    default = flow_timesteps(Bundle(shift=6.0), normal[:8], LossConfig(), (64, 64))
    torch.testing.assert_close(default, (shifted(unit_draw(normal[:8], LossConfig()), 6.0, None)
                                         * 1000).float())


def test_zimage_is_declared_flow_matching_where_the_config_layer_reads_it():
    for model_type, spec in MODEL_TYPES.items():
        # Klein's objective is flow matching with its pipeline's shift (families/klein.py)
        objective = family_of(model_type).objective
        assert spec.flow_matching == (objective.noisy_and_target is
                                      FLOW_MATCHING.noisy_and_target)
        samplers = family_of(model_type).samplers
        assert spec.samplers == (None if samplers is None else tuple(s.value for s in samplers))


def _problems(*overrides: str) -> dict[str, str]:
    config = apply_overrides(Config(), ["model.path=builtin:tiny-zimage", *overrides])
    return {p.path: p.message for p in validate(config) + family_problems(config)}


def test_flow_matching_options_are_refused_for_a_ddpm_family_with_the_reason():
    problems = _problems("model.path=builtin:tiny-sd15", "model.type=SD15",
                         "loss.timestep_sampling=LOGIT_NORMAL", "loss.timestep_shift=3",
                         "loss.dynamic_shift=true")
    for path in ("loss.timestep_sampling", "loss.timestep_shift", "loss.dynamic_shift"):
        assert "DDPM's integer timesteps" in problems[path]


def test_ddpm_options_are_refused_for_zimage_with_the_reason():
    problems = _problems("model.type=ZIMAGE", "model.prediction_type=EPSILON",
                         "sampling.sampler=DDIM", "training.min_snr_gamma=5",
                         "loss.debiased_estimation=true", "model.zero_terminal_snr=true")
    assert "flow matching" in problems["model.prediction_type"]
    assert "flow-matching Euler" in problems["sampling.sampler"]
    assert "no DDPM signal-to-noise ratio" in problems["training.min_snr_gamma"]
    assert "no DDPM signal-to-noise ratio" in problems["loss.debiased_estimation"]
    assert "no DDPM beta schedule" in problems["model.zero_terminal_snr"]
    clean = _problems("model.type=ZIMAGE", "sampling.sampler=EULER",
                      "loss.timestep_sampling=LOGIT_NORMAL", "loss.timestep_shift=3")
    assert not {k for k in clean if k.startswith(("loss.", "model.prediction", "sampling."))}
    both = _problems("model.type=ZIMAGE", "sampling.sampler=EULER", "loss.timestep_shift=3",
                     "loss.dynamic_shift=true")
    assert "replaces the fixed one" in both["loss.timestep_shift"]
