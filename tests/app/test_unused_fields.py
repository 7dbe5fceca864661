"""Settings the config leaves unused are greyed with the reason (modules/config/field_rules.py,
app/field_states.py), and come back when a change through the form makes them count."""
from __future__ import annotations

from app.readable import readable
from modules.config.schema import Adapter, LRScheduler, Optimizer, TrainingMethod
from tests.app.conftest import pump


def view(app, path):
    found = app.registry.find(path)
    assert found is not None and found.path == path, f"no widget for {path}"
    return found


def greyed(app, path):
    """(enabled?, the reason), the reason checked against what the tooltip shows."""
    found = view(app, path)
    reason = found.disabled_why
    if reason:  # the tooltip names values and fields as the window does
        own = found.info.enum_type if found.info.kind in ("enum", "list_enum") else None
        assert found.tooltips[0].text.startswith(f"Not used now: {readable(reason, own)}")
    return found.enabled, reason


def test_unused_settings_follow_the_form(app):
    cfg = app.binding.config
    assert greyed(app, "training.lora_rank") == (True, "")
    assert greyed(app, "training.module_dropout") == (
        False, "LoRA has no such option (LOHA / LOKR have it)")
    assert greyed(app, "training.lr_power") == (
        False, "only the POLYNOMIAL schedule reads it (CONSTANT is chosen)")
    assert greyed(app, "data.bucket_max_aspect") == (False, "aspect-ratio buckets are off")
    assert greyed(app, "training.prior_loss_weight") == (
        False, "no dataset is marked as regularisation images")

    view(app, "training.adapter").pick(Adapter.LOKR)
    assert cfg.training.adapter == Adapter.LOKR
    assert greyed(app, "training.module_dropout") == (True, "")
    assert greyed(app, "training.lokr_factor") == (True, "")
    assert greyed(app, "training.use_rslora") == (
        False, "LoKr has no such option (LORA / LOCON / DORA have it)")

    view(app, "training.method").pick(TrainingMethod.FINE_TUNE)
    for path in ("training.adapter", "training.lora_rank", "training.conv_rank",
                 "training.lokr_factor", "training.lora_target_modules"):
        assert greyed(app, path) == (False, "FINE_TUNE trains the full weights, with no "
                                            "adapter"), path
    assert view(app, "training.lora_rank").input.cget("state") == "disabled"  # and looks it

    view(app, "training.lr_scheduler").pick(LRScheduler.POLYNOMIAL)
    assert greyed(app, "training.lr_power") == (True, "")
    assert view(app, "training.lr_power").input.cget("state") == "normal"
    view(app, "training.optimizer").pick(Optimizer.ADAFACTOR_RELATIVE)
    assert cfg.training.optimizer == Optimizer.ADAFACTOR_RELATIVE
    for path in ("training.learning_rate", "training.lr_power", "training.lr_warmup_steps"):
        assert greyed(app, path) == (False, "Adafactor (relative step) sets its own step size")
    assert greyed(app, "training.lr_scheduler") == (True, "")

    view(app, "data.aspect_buckets").toggle.toggle()               # a click
    assert cfg.data.aspect_buckets is True
    assert greyed(app, "data.bucket_max_aspect") == (True, "")
    view(app, "data.datasets[0].regularization").toggle.toggle()
    pump(app)
    assert cfg.data.datasets[0].regularization is True
    assert greyed(app, "training.prior_loss_weight") == (True, "")

    view(app, "sampling.prompts").set_text("")
    assert cfg.sampling.prompts == []
    assert greyed(app, "sampling.guidance_scale") == (
        False, "there are no prompts, so nothing is sampled")


def test_validation_fields_are_greyed_while_validation_is_off(app):
    off = "validation is off (validation.every_steps is 0)"
    for path in ("validation.split_ratio", "validation.folder"):
        assert greyed(app, path) == (False, off), path
        assert view(app, path).label.cget("text_color") != view(
            app, "validation.every_steps").label.cget("text_color")   # the label looks it too
    assert "“Validate every N steps” is 0" in view(app, "validation.folder").tooltips[0].text
    view(app, "validation.every_steps").var.set("50")              # typed
    pump(app)
    assert greyed(app, "validation.split_ratio") == (True, "")
    assert greyed(app, "validation.folder") == (True, "")
