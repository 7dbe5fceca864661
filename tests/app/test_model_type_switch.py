"""Switching the model type (issue 54 item 4): a setting the new type allows one value of takes
it (Z-Image kept *Sampler: DDIM* while its menu offered only Euler, then refused to start over
it), and the settings only another type reads are greyed, with why (Z-Image's files stayed
enabled on SD presets)."""
from __future__ import annotations

from app.labels import enum_label
from modules.config.outputs import Sampler
from modules.config.schema import PredictionType
from modules.model_types import ModelType
from tests.app.test_unused_fields import greyed, view

ZIMAGE_ONLY = ("model.text_encoder_path", "model.vae_path", "model.train_distilled")


def test_zimage_takes_its_only_sampler_and_its_own_fields_grey_elsewhere(app):
    cfg = app.binding.config
    cfg_sampler = view(app, "sampling.sampler")
    view(app, "sampling.sampler").pick(Sampler.DDIM)
    view(app, "model.prediction_type").pick(PredictionType.V_PREDICTION)
    assert cfg.model.type == ModelType.SD15
    for path in ZIMAGE_ONLY:                  # an SD type: Z-Image's files are not read
        assert greyed(app, path) == (False, "Stable Diffusion 1.x models do not read it "
                                            "(Z-Image / Flux.2 Klein only)"), path

    view(app, "model.type").pick(ModelType.ZIMAGE)
    assert cfg.sampling.sampler == Sampler.EULER                   # its only sampler
    assert cfg_sampler.menu.get() == enum_label(Sampler.EULER)     # and the menu shows it
    assert cfg.model.prediction_type == PredictionType.AUTO        # flow matching's only one
    assert "Sampling › Sampler: Euler" in app.run_panel.status_text
    assert not [p for p in app.binding.problems(check_files=False)
                if p.path in ("sampling.sampler", "model.prediction_type")]
    for path in ZIMAGE_ONLY:
        assert greyed(app, path) == (True, ""), path

    view(app, "model.type").pick(ModelType.SDXL)
    assert cfg.sampling.sampler == Sampler.EULER                   # valid there too: kept
    for path in ZIMAGE_ONLY:
        assert greyed(app, path)[0] is False, path
