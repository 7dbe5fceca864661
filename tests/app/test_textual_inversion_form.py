"""The textual inversion fields in the window: built from their metadata in the Training tab,
usable only with the TEXTUAL_INVERSION method (greyed with the reason otherwise, as the
adapter's fields are for FINE_TUNE), and what is typed lands in the config."""
from __future__ import annotations

from modules.config.schema import TrainingMethod
from tests.app.test_unused_fields import greyed, view

TI_FIELDS = ("textual_inversion.placeholder", "textual_inversion.vectors",
             "textual_inversion.initializer")


def test_textual_inversion_fields_count_only_for_their_method(app):
    cfg = app.binding.config
    for path in TI_FIELDS:
        assert greyed(app, path) == (False, "only TEXTUAL_INVERSION reads it (LORA is chosen)")
    assert greyed(app, "components.text_encoder.train") == (True, "")

    view(app, "training.method").pick(TrainingMethod.TEXTUAL_INVERSION)
    assert cfg.training.method == TrainingMethod.TEXTUAL_INVERSION
    for path in TI_FIELDS:
        assert greyed(app, path) == (True, ""), path
    assert view(app, "textual_inversion.placeholder").input.cget("state") == "normal"
    assert greyed(app, "training.lora_rank") == (
        False, "TEXTUAL_INVERSION trains new token embeddings, with no adapter")
    assert greyed(app, "components.text_encoder.train") == (
        False, "TEXTUAL_INVERSION trains the new token's embeddings in every text encoder, "
               "and nothing else")

    view(app, "textual_inversion.placeholder").var.set("<mychar>")
    view(app, "textual_inversion.vectors").var.set("4")
    view(app, "textual_inversion.initializer").var.set("person")
    ti = cfg.textual_inversion
    assert (ti.placeholder, ti.vectors, ti.initializer) == ("<mychar>", 4, "person")

    view(app, "training.method").pick(TrainingMethod.LORA)
    assert greyed(app, "textual_inversion.vectors") == (
        False, "only TEXTUAL_INVERSION reads it (LORA is chosen)")
