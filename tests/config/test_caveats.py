"""What a valid config does that the user should hear of before training (issue 44): settings
it leaves unused though they were set, and a DoRA text encoder in diffusers files."""
from __future__ import annotations

from modules.config import Config, apply_overrides
from modules.config.caveats import DORA_TEXT_ENCODER, config_warnings, unused_settings


def config_with(*assignments: str) -> Config:
    return apply_overrides(Config(), list(assignments))


def test_fine_tune_with_a_lycoris_adapter_is_warned_naming_the_field_and_the_fix():
    config = config_with("training.method=FINE_TUNE", "training.adapter=LOHA",
                         "output.formats=diffusers")
    (warning,) = config_warnings(config)
    assert warning.startswith("training.adapter is LOHA, but it is not used: FINE_TUNE trains "
                              "the full weights, with no adapter")
    assert "set it back to LORA" in warning


def test_only_values_the_user_changed_are_warned():
    assert config_warnings(Config()) == []
    assert unused_settings(config_with("training.method=FINE_TUNE",
                                       "output.formats=diffusers")) == {}  # defaults: quiet
    unused = unused_settings(config_with("training.optimizer=ADAFACTOR_RELATIVE",
                                         "training.learning_rate=0.001"))
    assert list(unused) == ["training.learning_rate"]
    assert "sets its own step size" in unused["training.learning_rate"]


def test_a_dora_text_encoder_in_diffusers_files_is_warned():
    dora = ("training.adapter=DORA", "components.text_encoder.train=true")
    assert config_warnings(config_with(*dora)) == [DORA_TEXT_ENCODER]
    assert config_warnings(config_with(*dora, "output.formats=kohya")) == []
    assert config_warnings(config_with("training.adapter=DORA")) == []  # the UNet loads exactly
    # the advice names the loader that applies the KOHYA file's DoRA exactly (docs/adapters.md:
    # LyCORIS), and says that ComfyUI / Forge approximate it and A1111's loader mis-applies it
    advice = DORA_TEXT_ENCODER.split("For the text encoder's DoRA as trained", 1)[1]
    assert "LyCORIS, which applies it exactly" in advice
    assert "ComfyUI and Forge render a DoRA approximately" in advice
    assert "A1111's built-in loader mis-applies it" in advice
