"""The A1111 card beside a kohya LoRA keeps the user's edits across saves
(modules/models/a1111_card.py): Tempera's own fields are refreshed, the user's kept, and an
unreadable card is kept as .bak with a warning, never dropped."""
from __future__ import annotations

import json

from modules.events import RecordingCallbacks
from modules.models.a1111_card import merge_card
from modules.train.trainer import train

NEW = {"description": "LoRA for Stable Diffusion 1.x, trained with Tempera for 8 steps.",
       "sd version": "SD1", "activation text": "sks dog", "preferred weight": 0,
       "notes": "Base model: tiny-sd15"}


def test_tempera_fields_are_refreshed_and_the_users_are_kept(tmp_path):
    card = tmp_path / "lora_kohya.json"
    assert merge_card(NEW, card).card == NEW                  # no card yet: Tempera's
    card.write_text(json.dumps({
        "description": "LoRA for Stable Diffusion 1.x, trained with Tempera for 4 steps.",
        "sd version": "SD2", "activation text": "old words", "preferred weight": 0.7,
        "notes": "Base model: tiny-sd15", "negative text": "blurry"}))
    assert merge_card(NEW, card).card == {**NEW, "preferred weight": 0.7,
                                          "negative text": "blurry"}
    card.write_text(json.dumps({"description": "My dog, in watercolours",
                                "notes": "use with the watercolour base\nweight 0.6 is best"}))
    merged = merge_card(NEW, card)
    assert merged.card == {**NEW, "description": "My dog, in watercolours",
                           "notes": "use with the watercolour base\nweight 0.6 is best"}
    assert merged.backup is None and merged.warning is None


def test_an_unreadable_card_is_kept_as_bak_with_a_warning(tmp_path):
    card = tmp_path / "lora_kohya.json"
    for text, why in (('{"description": "mine",', "not valid JSON"),
                      ('["a list"]', "not a JSON object (a list)")):
        card.write_text(text)
        update = merge_card(NEW, card)
        assert update.card == NEW and update.backup == text
        assert why in update.warning and "kept as lora_kohya.json.bak" in update.warning


def test_a_save_over_an_edited_card_keeps_the_edits(tiny_config):
    settings = ("training.max_steps=1", 'output.formats=["KOHYA"]', "output.overwrite=true")
    first = train(tiny_config(*settings))
    card = first.output_dir / "final" / "lora_kohya.json"
    edited = {**json.loads(card.read_text()), "description": "mine", "preferred weight": 0.8,
              "activation text": "not the trigger words"}
    card.write_text(json.dumps(edited))
    train(tiny_config(*settings, "training.max_steps=2"))
    saved = json.loads(card.read_text())
    assert saved["description"] == "mine" and saved["preferred weight"] == 0.8
    assert saved["activation text"] == ""  # Tempera's: this run has no trigger words

    card.write_text("{broken")
    callbacks = RecordingCallbacks()
    train(tiny_config(*settings), callbacks)
    assert (card.parent / "lora_kohya.json.bak").read_text() == "{broken"
    assert json.loads(card.read_text())["description"].endswith("trained with Tempera for 1 "
                                                                "steps.")
    assert any("lora_kohya.json is not valid JSON" in s for s in callbacks.statuses)
    train(tiny_config(*settings))  # a later save carries the .bak along
    assert (card.parent / "lora_kohya.json.bak").read_text() == "{broken"
