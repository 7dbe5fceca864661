"""The family seam holds for a family that is not SD: a tiny DiT with a flow-matching target
(tests/models/dit_family.py) trains, compiles REGIONAL over its transformer blocks, saves and
resumes exactly, through the same training step, compile guard and backups as SD."""
from __future__ import annotations

import math

import pytest
import torch

from modules.events import RecordingCallbacks
from modules.train.trainer import train
from tests.models.dit_family import DIT, TRANSFORMER, build_tiny, use_dit_family
from tests.train.test_resume import final_tensors, run_json, stop_then_resume


@pytest.fixture(scope="module")
def dit_folder(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny-dit") / "model")


@pytest.fixture
def dit_config(tiny_config, dit_folder, monkeypatch):
    use_dit_family(monkeypatch)

    def make(*overrides: str):
        return tiny_config(f"model.path={dit_folder}", "training.method=FINE_TUNE",
                           "training.learning_rate=2e-3", *overrides)
    return make


def test_flow_matching_target_is_the_velocity_from_data_to_noise():
    latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)

    class Bundle:  # only the scheduler's config is read
        noise_scheduler = type("S", (), {"config": type("C", (), {"num_train_timesteps": 1000})})

    noisy, target = DIT.objective.noisy_and_target(Bundle, latents, noise,
                                                   torch.tensor([0, 500]))
    assert torch.equal(noisy[0], latents[0])  # t = 0: clean data
    assert torch.allclose(noisy[1], 0.5 * latents[1] + 0.5 * noise[1])
    assert torch.equal(target, noise - latents)


def test_dit_family_trains_and_saves_its_transformer(dit_config, tmp_path):
    result = train(dit_config("training.max_steps=12", f"output.dir={tmp_path / 'out'}"))

    losses = run_json(result.output_dir)["losses"]
    assert len(losses) == 12 and all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-4:]) < sum(losses[:4]), losses  # it learns
    saved = result.output_dir / "final" / "transformer"
    assert (saved / "config.json").is_file() and not (result.output_dir / "final" / "unet").exists()


def test_dit_family_compiles_regional_over_its_transformer_blocks(dit_config, tmp_path):
    callbacks = RecordingCallbacks()
    result = train(dit_config("compile.backend=AOT_EAGER", "compile.scope=REGIONAL",
                              "compile.denoiser=true", f"output.dir={tmp_path / 'out'}"), callbacks)

    report = run_json(result.output_dir)["compile"]["unet"]  # the engine's denoiser entry
    assert report["effective"] == "AOT_EAGER" and report["scope"] == "REGIONAL", report
    assert report["compiled_code_ran"] and not report["degraded"], report
    blocks = f"regional, {TRANSFORMER['num_layers']} blocks"
    assert any(blocks in event.message for event in callbacks.compile_events)


def test_dit_family_resumes_exactly(dit_config, tmp_path):
    settings = ("training.max_steps=6", "training.lr_scheduler=COSINE")
    train(dit_config(*settings, f"output.dir={tmp_path / 'whole'}"), RecordingCallbacks())
    stop_then_resume(dit_config(*settings, f"output.dir={tmp_path / 'parts'}"), at=3)

    expected, got = run_json(tmp_path / "whole"), run_json(tmp_path / "parts")
    assert got["losses"] == expected["losses"] and got["resume_count"] == 1
    want, have = final_tensors(tmp_path / "whole"), final_tensors(tmp_path / "parts")
    assert want.keys() == have.keys() and want
    assert all(torch.equal(want[key], have[key]) for key in want)
