"""Switching the model type (issue 54 item 4): a setting the new type allows one value of takes
it (Z-Image kept *Sampler: DDIM* while its menu offered only Euler, then refused to start over
it), and the settings only another type reads are greyed, with why (Z-Image's files stayed
enabled on SD presets); Flux.2 Klein's labels and the settings it does not read, greyed with
why. The tests share one window (`shared_app`)."""
from __future__ import annotations

import pytest

from app.labels import enum_label
from modules.config.outputs import Sampler
from modules.config.schema import PredictionType
from modules.model_types import MODEL_TYPES, ModelType
from tests.app.test_unused_fields import greyed, view

ZIMAGE_ONLY = ("model.text_encoder_path", "model.vae_path", "model.train_distilled")
SD_TYPES = "Stable Diffusion 1.x / Stable Diffusion 2.x / Stable Diffusion XL"
# what Flux.2 Klein does not read, and who does: an SD checkpoint file's companions, Z-Image's
# ComfyUI files (Klein's are recognised and refused, not loaded yet: docs/klein.md)
KLEIN_UNREAD = {"model.allow_pickle": SD_TYPES, "training.channels_last": SD_TYPES}
DDPM_SETTINGS = ("model.prediction_type", "model.zero_terminal_snr", "training.min_snr_gamma",
                 "loss.debiased_estimation")
FLOW_SETTINGS = ("loss.timestep_sampling", "loss.timestep_shift", "loss.dynamic_shift")


@pytest.fixture
def app(shared_app):
    return shared_app


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


def test_klein_names_its_parts_and_greys_what_it_does_not_read_with_why(app):
    """Switched to Flux.2 Klein: its Euler sampler taken, its denoiser called the Transformer
    (section and compile checkbox), SDXL's second text encoder greyed, every setting Klein
    does not read greyed with who reads it (DDPM's own with why), its own distillation switch
    and flow matching's settings live; and the LoRA tools' menu lists it, from the table."""
    cfg = app.binding.config
    view(app, "model.type").pick(ModelType.KLEIN)
    assert cfg.model.type == ModelType.KLEIN
    assert view(app, "model.type").menu.get() == "Flux.2 Klein"
    assert view(app, "sampling.sampler").menu.cget("values") == [enum_label(Sampler.EULER)]
    assert cfg.sampling.sampler == Sampler.EULER
    assert "Flux.2 Klein allows one value of these, now set: Sampling › Sampler: Euler" in (
        app.run_panel.status_text)
    assert not [p for p in app.binding.problems(check_files=False)
                if p.path in ("sampling.sampler", "model.prediction_type")]
    assert view(app, "compile.denoiser").toggle.cget("text") == "Transformer"
    assert app.registry.section_titles["components.denoiser"].cget("text") == "Transformer"
    assert app.registry.section_titles["components.text_encoder_2"].cget("text") == (
        "Text encoder 2 (Stable Diffusion XL only)")
    assert greyed(app, "components.text_encoder_2.train") == (
        False, "Flux.2 Klein models have no text encoder 2")
    for path, readers in KLEIN_UNREAD.items():
        assert greyed(app, path) == (False, f"Flux.2 Klein models do not read it ({readers} "
                                            "only)"), path
    for path in DDPM_SETTINGS:
        assert greyed(app, path) == (False, "Flux.2 Klein is trained with flow matching, "
                                            "which has no DDPM schedule"), path
    for path in ("model.train_distilled", "components.text_encoder.train", *FLOW_SETTINGS,
                 # ComfyUI's split files, which Klein loads (and their tokenizer folder)
                 "model.text_encoder_path", "model.vae_path", "model.tokenizer_path"):
        assert greyed(app, path) == (True, ""), path
    menu = app.lora_tools.model_type.cget("values")
    assert menu == ["from the base model", *(spec.short_label for spec in MODEL_TYPES.values())]
    assert "Klein" in menu

    view(app, "model.type").pick(ModelType.SD15)      # an SD type reads its file's companions
    for path in ("model.tokenizer_path", "model.config_path", "model.allow_pickle"):
        assert greyed(app, path) == (True, ""), path
    assert greyed(app, "model.train_distilled") == (
        False, "Stable Diffusion 1.x models do not read it (Z-Image / Flux.2 Klein only)")
