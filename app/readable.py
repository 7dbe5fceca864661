"""Engine text as the window names things.

The engine's messages, help texts and reasons are written for the config file and the command
line, which the CLI and docs/config.md show as they are: config values (`LOHA`), dotted config
paths (`output.overwrite`) and command-line flags (`--resume latest`). The window shows labels
for all of these (*LoHa*, *Overwrite previous run*, the **Resume** button), so what it shows of
that text goes through `readable`, which puts the window's name in place of each name it has one
for and leaves every other word as it is.
"""
from __future__ import annotations

import functools
import re
from enum import Enum

from app.fields import container_labels, iter_fields
from app.labels import ENUM_LABELS
from modules.config import Config

# Values that are also ordinary words or terms in the engine's text ("on the CPU", "a CUDA
# GPU", "min SNR gamma", "MSE loss"); a value shared by enums whose labels differ (AUTO) is
# only named when the text's own field says which enum it is.
LEFT_AS_WORDS = frozenset({"CPU", "CUDA", "NO", "SNR", "MSE"})
# What the command line's words are in the window.
CLI_WORDS = (("resume with --resume latest", "Resume continues it"),
             ("--resume latest", "Resume"), ("--resume", "Resume"))
# a word in capitals, not part of a path or file name ("/data/SDXL/x.png", "LORA.json")
_VALUE = re.compile(r"(?<![\w./\\-])[A-Z][A-Z0-9_]*[A-Z0-9](?![\w/\\-]|\.\w)( \()?")
_PATH = re.compile(r"(?<![\w./\\-])([a-z][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z][a-z0-9_]*(?:\[\d+\])?)+)"
                   r"(?![\w/\\-]|\.[a-z])")
_INDEX = re.compile(r"\[(\d+)\]")


@functools.lru_cache(maxsize=1)
def _value_labels() -> dict[str, str]:
    """Each config value's label, for the values whose enums agree on it."""
    found: dict[str, set[str]] = {}
    for labels in ENUM_LABELS.values():
        for member, label in labels.items():
            found.setdefault(str(member.value), set()).add(label)
    return {value: labels.pop() for value, labels in found.items()
            if len(labels) == 1 and value not in LEFT_AS_WORDS}


@functools.lru_cache(maxsize=1)
def _path_labels() -> dict[str, str]:
    """Config path (a list's items as `list[].field`) -> the label the window shows for it."""
    sections = container_labels(Config)
    fields = {}
    for info in iter_fields(Config):
        fields[info.dotted_path] = info.label
        if info.kind == "list_dataclass":
            for sub in iter_fields(info.item_type, f"{info.dotted_path}[]"):
                fields[sub.dotted_path] = sub.label
    shared = {label for label in fields.values() if list(fields.values()).count(label) > 1}
    for path, label in fields.items():  # "Every N steps" is sampling's and validation's
        parent = path.rpartition(".")[0]
        if label in shared and parent in sections:
            fields[path] = f"{sections[parent]} › {label}"
    return {**sections, **fields}


def field_name(path: str) -> str | None:
    """A config path as the window names it: “Overwrite previous run”, “Datasets › row 2 ›
    Folder” (rows counted from 1); None when it is not a config path."""
    labels = _path_labels()
    row = _INDEX.search(path)
    if row is None:
        return f"“{labels[path]}”" if path in labels else None
    listed, rest = path[:row.start()], path[row.end():].lstrip(".")
    item = f"{listed}[].{rest}"
    if listed not in labels or (rest and item not in labels):
        return None
    parts = [labels[listed], f"row {int(row.group(1)) + 1}"] + ([labels[item]] if rest else [])
    return "“" + " › ".join(parts) + "”"


def readable(text: str, own: type[Enum] | None = None) -> str:
    """`text` with config values, config paths and command-line flags named as the window
    names them; `own`: the enum of the field the text describes (it decides a value several
    enums share, AUTO)."""
    if not text:
        return text
    for cli, window in CLI_WORDS:
        text = text.replace(cli, window)
    text = _PATH.sub(lambda m: field_name(m.group(1)) or m.group(0), text)
    values = _value_labels()
    own_labels = {str(m.value): label for m, label in ENUM_LABELS.get(own, {}).items()} \
        if own is not None else {}

    def value(match: re.Match) -> str:
        word, bracket = match.group(0).removesuffix(" ("), match.group(1) or ""
        label = own_labels.get(word) or values.get(word)
        if label is None:
            return match.group(0)
        if bracket and label.endswith(")"):  # "LOCON (LoRA on ...)": one bracket, not two
            short, inner = label[:-1].split(" (", 1)
            if text.startswith(inner, match.end()):  # "ADAFACTOR (fixed learning rate)"
                return short + " ("
            return f"{short} ({inner}; "
        return label + bracket

    return _VALUE.sub(value, text)
