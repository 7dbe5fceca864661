"""The noise and loss options through the real trainer: each changes training and the defaults
change nothing, a run with them resumes bit for bit and compiles without recompiles after
warm-up, zero-terminal-SNR v-prediction SDXL trains and samples on the rescaled schedule, and
what cannot work is refused with the field's dotted path."""
from __future__ import annotations

import math

import pytest
import torch
from diffusers import DDPMScheduler
from safetensors import safe_open

from modules.config import validate
from modules.config.problems import ConfigError
from modules.config.schema import Sampler
from modules.events import RecordingCallbacks
from modules.models.families import sd as sd_family
from modules.train.outputs.sampling import sampling_scheduler
from modules.train.trainer import train
from modules.models.families import family_files
from tests.train.test_resume import assert_resumes_bit_for_bit, run_json

OPTIONS = ("loss.loss_type=HUBER", "loss.huber_schedule=SNR", "loss.debiased_estimation=true",
           "training.min_snr_gamma=5", "loss.min_timestep=100", "loss.max_timestep=900",
           "training.noise_offset=0.05", "loss.adaptive_noise_scale=0.1",
           "loss.multires_noise_iterations=4", "loss.input_perturbation=0.1")


def losses(result) -> list[float]:
    return run_json(result.output_dir)["losses"]


def problems_of(error: pytest.ExceptionInfo) -> dict[str, str]:
    return {p.path: f"{p.expected} | {p.given} | {p.message}" for p in error.value.problems}


def test_each_option_changes_training_and_the_defaults_change_nothing(tiny_config, tmp_path):
    def run(name, *overrides):
        return losses(train(tiny_config("training.max_steps=2",
                                        f"output.dir={tmp_path / name}", *overrides)))

    base = run("base")
    assert run("defaults", "loss.loss_type=MSE", "loss.min_timestep=0", "loss.max_timestep=1000",
               "loss.debiased_estimation=false", "loss.multires_noise_iterations=0",
               "loss.input_perturbation=0", "loss.huber_c=0.5") == base
    for i, option in enumerate([("loss.loss_type=HUBER",), ("loss.loss_type=SMOOTH_L1",),
                   ("loss.debiased_estimation=true",), ("loss.min_timestep=900",),
                   ("loss.multires_noise_iterations=6",), ("loss.input_perturbation=0.1",),
                   ("training.noise_offset=0.1", "loss.adaptive_noise_scale=1.0")]):
        got = run(f"option-{i}", *option)
        assert all(math.isfinite(x) for x in got) and got != base, f"{option} changed nothing"


def test_a_run_with_the_options_resumes_bit_for_bit(tiny_config, tmp_path):
    settings = ("training.max_steps=4", "training.gradient_accumulation=2", *OPTIONS)
    assert_resumes_bit_for_bit(tiny_config, tmp_path, settings)


def test_compiled_run_with_the_options_does_not_recompile_after_warm_up(tiny_config):
    import torch._dynamo
    torch._dynamo.reset()  # count only this run's compiles
    callbacks = RecordingCallbacks()
    try:
        result = train(tiny_config("training.max_steps=4", "compile.backend=AOT_EAGER",
                                   "loss.huber_schedule=EXPONENTIAL", *OPTIONS), callbacks)
    finally:
        torch._dynamo.reset()
    record = run_json(result.output_dir)
    unet = record["compile"]["unet"]
    assert unet["effective"] == "AOT_EAGER" and unet["compiled_code_ran"], unet
    assert record["batch_shapes"]["recompiles_after_first_pass"] == 0
    assert not any(e.kind == "recompile" for e in callbacks.compile_events)
    assert all(math.isfinite(x) for x in record["losses"])


# --- zero terminal SNR and v-prediction ------------------------------------------------------
def test_zero_terminal_snr_rescales_the_schedule_and_every_sampler_starts_from_pure_noise():
    base = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                         prediction_type="v_prediction")
    rescaled = sd_family.ddpm_zero_terminal_snr(base)
    # Lin et al. 2023: sqrt(alpha_bar) shifted so its last value is 0, scaled so its first stays
    root = base.alphas_cumprod.double().sqrt()
    expected = ((root - root[-1]) * root[0] / (root[0] - root[-1])) ** 2
    assert torch.allclose(rescaled.alphas_cumprod.double(), expected, rtol=1e-4, atol=1e-7)
    assert rescaled.alphas_cumprod[-1] == 0 and rescaled.config.prediction_type == "v_prediction"
    for sampler in Sampler:
        scheduler = sampling_scheduler(sampler, rescaled.config)
        assert scheduler.config.rescale_betas_zero_snr, sampler
        scheduler.set_timesteps(4)
        assert int(scheduler.timesteps[0]) == 999, sampler  # "trailing": the pure-noise step


def test_sdxl_v_prediction_with_zero_terminal_snr_trains_samples_and_says_so(tiny_config):
    result = train(tiny_config("model.path=builtin:tiny-sdxl", "model.type=SDXL",
                               "training.batch_size=1", "model.prediction_type=V_PREDICTION",
                               "model.zero_terminal_snr=true", "training.min_snr_gamma=5",
                               "loss.debiased_estimation=true", "training.max_steps=2",
                               "sampling.prompts=[\"a red circle --s 2\"]"))
    record = run_json(result.output_dir)
    assert record["noise_schedule"] == {
        "scheduler": "DDPMScheduler", "prediction_type": "v_prediction",
        "num_train_timesteps": 1000, "zero_terminal_snr": True, "timestep_spacing": "trailing"}
    assert all(math.isfinite(x) for x in record["losses"])
    assert (result.output_dir / "samples" / "step-000002-0.png").is_file()


def test_single_file_of_a_zero_terminal_snr_model_carries_comfyuis_markers(tiny_config):
    result = train(tiny_config("model.prediction_type=V_PREDICTION", "training.max_steps=1",
                               "model.zero_terminal_snr=true", "training.method=FINE_TUNE",
                               "output.formats=[\"SINGLE_FILE\"]"))
    with safe_open(result.output_dir / "final" / "model.safetensors", "pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
    assert {"v_pred", "ztsnr"} <= keys
    assert metadata["ss_zero_terminal_snr"] == "True"


# --- refusals ----------------------------------------------------------------------------------
def test_config_level_refusals_name_the_field(tiny_config):
    found = {p.path: p for p in validate(tiny_config(
        "loss.min_timestep=500", "loss.max_timestep=500", "loss.adaptive_noise_scale=0.2",
        "model.prediction_type=EPSILON", "model.zero_terminal_snr=true"))}
    assert found["loss.min_timestep"].expected == "less than loss.max_timestep (500)"
    assert "training.noise_offset" in found["loss.adaptive_noise_scale"].message
    assert found["model.prediction_type"].expected == "V_PREDICTION with model.zero_terminal_snr"


def test_zero_terminal_snr_on_a_model_that_predicts_epsilon_is_refused(tiny_config):
    with pytest.raises(ConfigError) as error:  # AUTO: the tiny SD 1.5 predicts epsilon
        train(tiny_config("model.zero_terminal_snr=true"))
    assert "this model predicts epsilon" in problems_of(error)["model.prediction_type"]


def test_max_timestep_beyond_the_models_schedule_is_refused(tiny_config):
    with pytest.raises(ConfigError) as error:
        train(tiny_config("loss.max_timestep=1001"))
    assert problems_of(error)["loss.max_timestep"].startswith("at most 1000")


@pytest.fixture
def zimage_config(tiny_config):
    """The tiny Z-Image, a flow-matching family, with its one sampler."""
    def make(*overrides: str):
        return tiny_config("model.type=ZIMAGE", "model.path=builtin:tiny-zimage",
                           "sampling.sampler=EULER", *overrides)
    return make


def test_flow_matching_family_refuses_the_snr_options_precisely(zimage_config):
    with pytest.raises(ConfigError) as error:
        train(zimage_config("training.min_snr_gamma=5", "loss.debiased_estimation=true",
                            "loss.loss_type=HUBER", "model.zero_terminal_snr=true",
                            "model.prediction_type=V_PREDICTION"))
    found = problems_of(error)
    assert set(found) == {"training.min_snr_gamma", "loss.debiased_estimation",
                          "loss.huber_schedule", "model.zero_terminal_snr",
                          "model.prediction_type"}
    assert found["loss.huber_schedule"].startswith("CONSTANT or EXPONENTIAL | SNR")
    assert "no DDPM signal-to-noise ratio" in found["training.min_snr_gamma"]


def test_flow_matching_family_trains_with_the_options_it_can_use(zimage_config, tmp_path):
    base = losses(train(zimage_config("training.max_steps=2",
                                      f"output.dir={tmp_path / 'base'}")))
    got = losses(train(zimage_config(
        "training.max_steps=2", f"output.dir={tmp_path / 'options'}", "loss.loss_type=HUBER",
        "loss.huber_schedule=EXPONENTIAL", "loss.min_timestep=200",
        "loss.multires_noise_iterations=3", "loss.input_perturbation=0.1",
        "training.noise_offset=0.05", "loss.adaptive_noise_scale=0.1")))
    assert got != base and all(math.isfinite(x) for x in got)


def test_a_checkpoint_marked_v_pred_and_ztsnr_is_read_as_such(tempera_cache, tmp_path):
    from modules.config import Config, apply_overrides
    from modules.config.schema import ModelType, PredictionType
    from modules.models.single_file import load_single_file_bundle, save_single_file
    from modules.train.recipe.loss_checks import model_problems
    from tests.models.test_single_file import _tiny

    folder, components = _tiny(ModelType.SD15, tempera_cache)
    components["scheduler"] = sd_family.ddpm_zero_terminal_snr(
        DDPMScheduler.from_config(components["scheduler"].config,
                                  prediction_type="v_prediction"))
    path = save_single_file(components, tmp_path / "noob.safetensors", family_files(ModelType.SD15))
    bundle = load_single_file_bundle(path, ModelType.SD15, PredictionType.AUTO,
                                     config_folder=folder)
    assert bundle.prediction_type == "v_prediction"  # AUTO reads ComfyUI's v_pred marker
    config = apply_overrides(Config(), [f"model.path={path}"])
    found = {p.path: p for p in model_problems(config, bundle)}
    assert found["model.zero_terminal_snr"].expected == "true for this checkpoint"
    config.model.zero_terminal_snr = True
    assert model_problems(config, bundle) == []
