"""The textual_inversion section's refusals, each naming its field and the fix (the
tokenizer's own refusals run on the loaded model: tests/train/test_textual_inversion.py)."""
from __future__ import annotations

import pytest

from modules.config import Config, apply_overrides
from modules.config.field_rules import unused_fields
from modules.config.problems import ConfigError
from modules.config.validate import validate

TI = ("training.method=TEXTUAL_INVERSION", "textual_inversion.placeholder=<mychar>",
      "textual_inversion.initializer=person")


def problems(*overrides: str) -> dict[str, str]:
    return {p.path: str(p) for p in validate(apply_overrides(Config(), [*TI, *overrides]))}


def test_a_complete_textual_inversion_config_validates_whatever_components_say():
    assert problems() == {}
    # the components' train switches are not read (greyed), so none on is no problem
    assert problems("components.denoiser.train=false") == {}
    assert "components.denoiser.train" in unused_fields(apply_overrides(Config(), list(TI)))


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_trigger_word_is_refused(value):
    found = problems(f"textual_inversion.placeholder={value}")
    assert "a trigger word such as <mychar>" in found["textual_inversion.placeholder"]


def test_a_trigger_word_with_a_space_is_refused():
    found = problems("textual_inversion.placeholder=my char")
    assert "one word without spaces" in found["textual_inversion.placeholder"]


def test_an_empty_initializer_is_refused():
    found = problems("textual_inversion.initializer=")
    assert "a word such as 'person'" in found["textual_inversion.initializer"]


def test_fewer_than_one_vector_is_refused_by_the_loader():
    with pytest.raises(ConfigError) as caught:
        apply_overrides(Config(), [*TI, "textual_inversion.vectors=0"])
    assert caught.value.problems[0].path == "textual_inversion.vectors"


def test_the_text_encoder_cache_is_refused():
    found = problems("data.cache_text_encoder_outputs=true")
    assert "false with TEXTUAL_INVERSION" in found["data.cache_text_encoder_outputs"]


def test_z_image_is_refused_with_the_reason():
    found = problems("model.type=ZIMAGE", "model.path=builtin:tiny-zimage")
    assert "chat language model" in found["training.method"]


def test_a_lora_only_save_format_is_refused():
    found = problems("output.formats=single_file")
    assert "DIFFUSERS or KOHYA" in found["output.formats[0]"]


def test_the_section_is_greyed_for_other_methods():
    unused = unused_fields(Config())
    assert unused["textual_inversion.placeholder"].startswith("only TEXTUAL_INVERSION")
