"""training.channels_last: the UNet trains channels-last, with the same losses, and may change
on resume."""
from __future__ import annotations

import json

import pytest
import torch

from modules.config.overrides import apply_overrides
from modules.config.schema import Config
from modules.config.loader import to_dict
from modules.train import trainer
from modules.train.state.backup import config_differences
from modules.train.recipe.recipe import TrainingRecipe


def _conv_weights(unet: torch.nn.Module) -> list[torch.Tensor]:
    weights = [p for p in unet.parameters() if p.dim() == 4]
    assert weights, "the UNet has no convolution weights"
    return weights


def _train(config, monkeypatch) -> tuple[list[float], list[tuple[bool, bool]]]:
    """Train; return the losses and, per 4-D UNet weight after training, whether it is
    (channels-last, contiguous in the default layout); a 1x1 kernel is both at once."""
    seen: dict = {}
    loop = TrainingRecipe.train

    def spy(recipe):
        result = loop(recipe)
        seen["layouts"] = [(w.is_contiguous(memory_format=torch.channels_last),
                            w.is_contiguous()) for w in _conv_weights(recipe.run.bundle.denoiser)]
        return result

    monkeypatch.setattr(TrainingRecipe, "train", spy)
    result = trainer.train(config)
    losses = json.loads((result.output_dir / "run.json").read_text())["losses"]
    return losses, seen["layouts"]


def test_channels_last_trains_the_unet_channels_last_with_the_same_losses(tiny_config, tmp_path,
                                                                          monkeypatch):
    off, off_layouts = _train(tiny_config(f"output.dir={tmp_path / 'off'}"), monkeypatch)
    on, on_layouts = _train(tiny_config(f"output.dir={tmp_path / 'on'}",
                                        "training.channels_last=true"), monkeypatch)
    assert all(default for _, default in off_layouts)
    assert not all(last for last, _ in off_layouts)
    assert all(last for last, _ in on_layouts)
    assert not all(default for _, default in on_layouts)
    assert len(on) == len(off) == 3
    assert on == pytest.approx(off, rel=1e-4, abs=1e-6)


def test_a_channels_last_fine_tune_saves_loadable_weights(tiny_config, tmp_path, monkeypatch):
    losses, layouts = _train(tiny_config(f"output.dir={tmp_path / 'ft'}", "training.max_steps=1",
                                         "training.method=FINE_TUNE",
                                         "training.channels_last=true"), monkeypatch)
    assert all(last for last, _ in layouts) and len(losses) == 1
    from diffusers import UNet2DConditionModel
    unet = UNet2DConditionModel.from_pretrained(tmp_path / "ft" / "final" / "unet")
    assert torch.isfinite(_conv_weights(unet)[0]).all()


def test_channels_last_may_change_on_resume():
    saved = to_dict(Config())
    current = to_dict(apply_overrides(Config(), ["training.channels_last=true"]))
    blocking, allowed = config_differences(saved, current)
    assert blocking == []
    assert allowed == ["training.channels_last: False -> True"]


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_denoiser_is_fed_its_own_layout_whatever_the_latents_came_in(channels_last):
    """The VAE's posterior mean is a strided slice (neither layout) and cached latents are
    contiguous: compiled code is keyed on its inputs' strides, so each would compile graphs of
    its own (a run caching its latents missed 4 of the 23 graphs of compile ahead's bundle,
    whose process encodes them). The denoiser's input is always its layout."""
    from types import SimpleNamespace

    from modules.train.recipe.step_inputs import denoiser_input

    config = apply_overrides(Config(), [f"training.channels_last={str(channels_last).lower()}"])
    run = SimpleNamespace(config=config)
    moments = torch.randn(2, 8, 8, 8).contiguous(memory_format=torch.channels_last)
    encoded, cached = moments[:, :4], torch.randn(2, 4, 8, 8)  # what VAE.encode's mean is
    assert not encoded.is_contiguous() and not encoded.is_contiguous(
        memory_format=torch.channels_last)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    for latents in (encoded, cached):
        fed = denoiser_input(run, latents)
        assert fed.is_contiguous(memory_format=layout) and torch.equal(fed, latents)
        assert fed.stride() == torch.empty(2, 4, 8, 8, memory_format=layout).stride()
