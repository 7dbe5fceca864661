"""The A1111 / Forge card beside a kohya LoRA (`<stem>.json`) across saves: the user's edits
in the extra-networks card editor survive the next save of the same folder.

A save rebuilds its folder from scratch (train/outputs/saving.py swaps in a new one), so the card
would be rewritten with Tempera's values every time, losing a description, notes or preferred
weight the user typed in A1111. `merge_card` keeps them: Tempera owns only the fields it
derives from the run ("sd version", "activation text" from the trigger words), and the
description and notes while they are still the ones Tempera wrote (they say the step count and
the base model); every other field, and an edited description or notes, keeps the user's value.
A card that is not a JSON object is never dropped silently: it is kept as `<stem>.json.bak`
and a warning says so.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPERA_FIELDS = ("sd version", "activation text")
# What Tempera itself writes into the two free-text fields (weights.py `_card_description`,
# `write_lora_kohya`'s notes): such a value is refreshed, anything else is the user's.
TEMPERA_TEXT = {"description": re.compile(r".* trained with Tempera for \d+ steps\."),
                "notes": re.compile(r"Base model: [^\n]*")}


@dataclass(frozen=True)
class CardUpdate:
    card: dict[str, Any]          # what to write as the card
    backup: str | None = None     # an unreadable previous card's text, to keep as .bak
    warning: str | None = None    # what to tell the user about it


def is_tempera_text(field: str, value: Any) -> bool:
    pattern = TEMPERA_TEXT.get(field)
    return isinstance(value, str) and pattern is not None and pattern.fullmatch(value) is not None


def merge_card(new: dict[str, Any], previous: Path) -> CardUpdate:
    """The card to write over `previous` (the card the folder holds now, if any): `new`
    (Tempera's card for this save) with the user's fields of the previous card kept."""
    if not previous.is_file():
        return CardUpdate(new)
    text = previous.read_text(encoding="utf-8", errors="replace")
    try:
        old = json.loads(text)
    except ValueError as exc:
        old, why = None, f"not valid JSON ({exc})"
    else:
        why = f"not a JSON object (a {type(old).__name__})"
    if not isinstance(old, dict):
        return CardUpdate(new, backup=text, warning=(
            f"{previous} is {why}: it was kept as {previous.name}.bak and a new card written "
            "(copy your edits from the .bak into the new card)"))
    merged = dict(old)
    for field, value in new.items():
        if (field in TEMPERA_FIELDS or field not in old
                or is_tempera_text(field, old[field])):
            merged[field] = value
    return CardUpdate(merged)
