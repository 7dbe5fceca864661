"""The noise and loss options (config `loss`, training.noise_offset / min_snr_gamma) on fixed
tensors: each changes the noise or the loss exactly as its definition says (the expected
values are computed here from the definitions, not by the functions under test), and the
defaults leave the loss what the plain MSE was."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from modules.config import Config, apply_overrides
from modules.config.loss import HuberSchedule, LossConfig, LossType
from modules.models.families import sd as sd_family
from modules.train.recipe import objectives
from modules.train.recipe.builders import draw_randomness

PREDICTION = torch.tensor([[[[0.0, 0.05], [1.0, -3.0]]], [[[2.0, 0.5], [-0.2, 0.0]]]])
TARGET = torch.tensor([[[[0.0, 0.0], [0.0, 0.0]]], [[[0.0, 0.0], [0.0, 1.0]]]])


def pseudo_huber(d: float, c: float) -> float:
    return 2 * c * (math.sqrt(d * d + c * c) - c)


def by_hand(fn, prediction=PREDICTION, target=TARGET, c=(0.5, 0.5)) -> torch.Tensor:
    """`fn(d, c)` of every element, with c per sample."""
    out = torch.empty_like(prediction)
    for b in range(prediction.shape[0]):
        for idx in torch.cartesian_prod(*[torch.arange(n) for n in prediction.shape[1:]]):
            i = (b, *idx.tolist())
            out[i] = fn(float(prediction[i] - target[i]), c[b])
    return out


def config_with(*overrides: str) -> Config:
    return apply_overrides(Config(), list(overrides))


# --- the loss per element and its reduction ------------------------------------------------
def test_default_loss_is_bit_for_bit_the_plain_mse():
    torch.manual_seed(0)
    prediction, target = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    per_element = objectives.elementwise_loss(prediction, target, LossType.MSE)
    assert torch.equal(objectives.diffusion_loss(per_element, None),
                       F.mse_loss(prediction, target))
    weights = torch.tensor([0.25, 2.0])
    per_sample = ((prediction - target) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(objectives.diffusion_loss(per_element, weights),
                          (per_sample * weights).mean(), rtol=1e-6)
    weights_default, c = objectives.timestep_terms(None, None, torch.tensor([5, 900]), Config())
    assert weights_default is None and c == 0.1  # the defaults read no SNR and weigh nothing


def test_huber_is_pseudo_huber_and_smooth_l1_is_it_over_c():
    huber = objectives.elementwise_loss(PREDICTION, TARGET, LossType.HUBER, 0.5)
    assert torch.allclose(huber, by_hand(pseudo_huber), atol=1e-6)
    smooth = objectives.elementwise_loss(PREDICTION, TARGET, LossType.SMOOTH_L1, 0.5)
    assert torch.allclose(smooth, by_hand(lambda d, c: pseudo_huber(d, c) / c), atol=1e-6)
    # the two regimes: about d^2 for |d| << c, about 2c|d| - 2c^2 for |d| >> c
    small = objectives.elementwise_loss(torch.tensor([1e-2]), torch.zeros(1), LossType.HUBER, 1.0)
    large = objectives.elementwise_loss(torch.tensor([1e3]), torch.zeros(1), LossType.HUBER, 0.1)
    assert small.item() == pytest.approx(1e-4, rel=1e-2)  # float32 cancellation
    assert large.item() == pytest.approx(2 * 0.1 * 1e3 - 2 * 0.01, rel=1e-5)


def test_huber_c_may_differ_per_sample():
    c = torch.tensor([0.1, 2.0])
    huber = objectives.elementwise_loss(PREDICTION, TARGET, LossType.HUBER, c)
    assert torch.allclose(huber, by_hand(pseudo_huber, c=(0.1, 2.0)), atol=1e-6)


def test_huber_schedules_follow_their_formulas():
    timesteps, snr = torch.tensor([0, 500, 1000]), torch.tensor([100.0, 1.0, 0.01])

    def c_of(schedule, c=0.1):
        loss = LossConfig(loss_type=LossType.HUBER, huber_c=c, huber_schedule=schedule)
        return objectives.huber_threshold(loss, timesteps, 1000, snr)

    assert c_of(HuberSchedule.CONSTANT) == 0.1
    assert torch.allclose(c_of(HuberSchedule.EXPONENTIAL),
                          torch.tensor([1.0, math.sqrt(0.1), 0.1]))
    expected = [(1 - 0.1) / (1 + 1 / math.sqrt(s)) ** 2 + 0.1 for s in snr.tolist()]
    assert torch.allclose(c_of(HuberSchedule.SNR), torch.tensor(expected))
    mse = LossConfig(huber_schedule=HuberSchedule.SNR)  # MSE: no schedule is computed
    assert objectives.huber_threshold(mse, timesteps, 1000, None) == 0.1


# --- timestep weights ---------------------------------------------------------------------
SNR = torch.tensor([99.0, 1.0, 0.25])


def test_debiased_estimation_weighs_by_one_over_sqrt_snr():
    assert torch.allclose(objectives.debiased_weights(SNR, "epsilon"),
                          torch.tensor([1 / 9.9498744, 1.0, 2.0]))
    # v-prediction: the same weight on the image error, sqrt(SNR) / (SNR + 1)
    assert torch.allclose(objectives.debiased_weights(SNR, "v_prediction"),
                          torch.tensor([math.sqrt(99) / 100, 0.5, 0.5 / 1.25]))


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_and_debiased_multiply_into_the_sample_weights(prediction_type):
    alphas = torch.tensor([0.99, 0.5, 0.2])
    timesteps = torch.tensor([0, 1, 2])
    snr = alphas / (1 - alphas)
    bundle = SimpleNamespace(noise_scheduler=SimpleNamespace(
        alphas_cumprod=alphas, config={"num_train_timesteps": 3}), prediction_type=prediction_type)
    config = config_with("training.min_snr_gamma=2", "loss.debiased_estimation=true")
    weights, c = objectives.timestep_terms(sd_family.DDPM, bundle, timesteps, config)
    divisor = snr + 1 if prediction_type == "v_prediction" else snr
    debiased = snr.sqrt() / (snr + 1) if prediction_type == "v_prediction" else 1 / snr.sqrt()
    assert torch.allclose(weights, torch.clamp(snr, max=2.0) / divisor * debiased)
    # and the reduction applies them per sample
    per_element = torch.stack([torch.full((1, 2, 2), float(i + 1)) for i in range(3)])
    expected = sum(w * (i + 1) for i, w in enumerate(weights.tolist())) / 3
    assert objectives.diffusion_loss(per_element, weights).item() == pytest.approx(expected)


# --- noise ----------------------------------------------------------------------------------
def test_adaptive_noise_offset_scales_with_the_latent_channel_mean():
    latents = torch.zeros(2, 2, 2, 2)
    latents[0, 0] = 0.5   # mean 0.5
    latents[1, 1] = -2.0  # mean -2: |mean| 2
    noise, draw = torch.zeros(2, 2, 2, 2), torch.ones(2, 2, 1, 1)
    strength = objectives.noise_offset_strength(latents, 0.1, 0.2)
    expected = torch.tensor([[0.1 + 0.2 * 0.5, 0.1], [0.1, 0.1 + 0.2 * 2.0]]).view(2, 2, 1, 1)
    assert torch.allclose(strength, expected)
    assert torch.allclose(objectives.offset_noise(noise, draw, strength),
                          expected.expand(2, 2, 2, 2))
    negative = objectives.noise_offset_strength(latents, 0.1, -0.5)  # clamped at zero
    assert negative[1, 1].item() == 0.0 and negative[0, 1].item() == pytest.approx(0.1)
    assert objectives.noise_offset_strength(latents, 0.1, 0.0) == 0.1


def test_multires_noise_adds_upsampled_levels_and_rescales_to_unit_variance():
    torch.manual_seed(1)
    noise = torch.randn(2, 3, 4, 4)
    full = torch.randn(2, 3, 4, 4)        # level 0: at full size, upsampling keeps it
    coarse = torch.randn(2, 3, 1, 1)      # level 1: one cell, upsampled to a constant
    got = objectives.multires_noise(noise, (full, coarse), 0.3)
    total = noise + full + 0.3 * coarse.expand(2, 3, 4, 4)
    assert torch.allclose(got, total / total.std(), atol=1e-6)
    assert got.std().item() == pytest.approx(1.0, rel=1e-5)
    assert objectives.multires_noise(noise, (), 0.3) is noise


def test_multires_levels_shrink_by_two_to_four_times_per_level_down_to_one_cell():
    generator = torch.Generator().manual_seed(0)
    draws = draw_randomness(generator, (2, 4, 64, 64), (0, 1000), False,
                            LossConfig(multires_noise_iterations=10))
    sizes = [level.shape[-1] for level in draws.multires]
    assert sizes[0] == 64 and sizes[-1] == 1 and len(sizes) < 10  # stopped at one cell
    for i, size in enumerate(sizes[1:-1], start=1):
        assert 64 / 4 ** i <= size <= 64 / 2 ** i
    assert all(level.shape[:2] == (2, 4) for level in draws.multires)


def test_input_perturbation_noises_the_input_but_not_the_target():
    alphas = torch.tensor([0.9, 0.5])
    scheduler = SimpleNamespace(
        add_noise=lambda x, n, t: alphas[t].sqrt().view(-1, 1, 1, 1) * x
        + (1 - alphas[t]).sqrt().view(-1, 1, 1, 1) * n)
    bundle = SimpleNamespace(noise_scheduler=scheduler, prediction_type="epsilon")
    latents, noise, extra = torch.ones(2, 1, 2, 2), torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2)
    timesteps = torch.tensor([0, 1])
    noisy, target = objectives.noisy_input_and_target(sd_family.DDPM, bundle, latents, noise,
                                                      timesteps, extra, 0.1)
    expected = torch.tensor([math.sqrt(0.9) + math.sqrt(0.1) * 0.1,
                             math.sqrt(0.5) + math.sqrt(0.5) * 0.1]).view(2, 1, 1, 1)
    assert torch.allclose(noisy, expected.expand(2, 1, 2, 2))
    assert torch.equal(target, noise)


# --- the draws ------------------------------------------------------------------------------
def test_the_default_draws_are_the_ones_drawn_before_the_options_existed():
    shape = (2, 4, 8, 8)
    generator = torch.Generator().manual_seed(7)
    draws = draw_randomness(generator, shape, (0, 1000), True, LossConfig())
    reference = torch.Generator().manual_seed(7)  # the order draw_randomness always had
    expected = [torch.randn(shape, generator=reference), torch.randn(shape, generator=reference),
                torch.randint(0, 1000, (2,), generator=reference),
                torch.randn((2, 4, 1, 1), generator=reference),
                torch.rand((2,), generator=reference)]
    got = [draws.vae_eps, draws.noise, draws.timesteps, draws.noise_offset,
           draws.caption_dropout]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert draws.perturbation is None and draws.multires == ()
    assert torch.equal(generator.get_state(), reference.get_state())  # nothing more drawn


def test_timesteps_are_drawn_from_the_range_and_options_do_not_shift_earlier_draws():
    shape = (64, 4, 8, 8)
    plain = draw_randomness(torch.Generator().manual_seed(3), shape, (0, 1000), False)
    ranged = draw_randomness(torch.Generator().manual_seed(3), shape, (200, 300), False,
                             LossConfig(input_perturbation=0.1, multires_noise_iterations=3))
    assert ranged.timesteps.shape == (64,)
    assert 200 <= ranged.timesteps.min() and ranged.timesteps.max() < 300
    assert torch.equal(ranged.noise, plain.noise)
    assert torch.equal(ranged.noise_offset, plain.noise_offset)
    assert ranged.perturbation.shape == shape and len(ranged.multires) == 3
