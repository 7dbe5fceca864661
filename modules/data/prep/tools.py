"""The preparation tools as one table for the front ends: the Data tab builds a window from a
row (its settings' fields, with their help and choices, its presets, the function that runs
it) and knows no tool by name; `tempera-data` reads the same settings classes.

A row's settings are a frozen dataclass whose fields carry ``help`` (and ``choices`` where
there are a few) in their metadata; `parse_setting` turns what a user typed into a field's type
and names the setting when it cannot.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the job module imports torch; this table is read before it is loaded
    from modules.data.prep.job import JobHooks, JobReport


def setting_label(name: str) -> str:
    """A setting's label in a window: ``max_tokens`` -> "Max tokens"."""
    return name.replace("_", " ").capitalize()


def setting_text(value: Any) -> str:
    """A setting's value as a user types it: a list of words comma-separated."""
    if isinstance(value, (tuple, list)):
        return ", ".join(str(v) for v in value)
    return str(value)


def parse_setting(f: dataclasses.Field, value: str | bool) -> Any:
    """What a user typed for ``f``, as the field's type; ValueError naming the setting."""
    kind = str(f.type)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = value.strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{setting_label(f.name)}: {value!r} is neither yes nor no")
    text = str(value).strip()
    if kind.startswith("tuple["):
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if kind in ("int", "float"):
        try:
            return int(text) if kind == "int" else float(text)
        except ValueError:
            what = "a whole number" if kind == "int" else "a number"
            raise ValueError(f"{setting_label(f.name)}: {text!r} is not {what}") from None
    choices = f.metadata.get("choices")
    if choices and text not in choices:
        raise ValueError(f"{setting_label(f.name)}: {text!r} is not one of "
                         f"{', '.join(map(str, choices))}")
    return text


Run = Callable[[Path, Any, "JobHooks", threading.Event], "JobReport"]


@dataclass(frozen=True)
class PrepTool:
    """One preparation tool: what a front end needs to offer it."""
    key: str                               # "caption", "mask": the command's name
    title: str                             # the window's title
    settings_type: type                    # the settings dataclass
    presets: Mapping[str, str]             # preset name -> one line on what it is for
    make_preset: Callable[[str], Any]      # a preset's settings
    run: Run                               # (folder, settings, hooks, stop) -> the report
    hooks: type                            # JobHooks: how the job reports back
    refused: type                          # JobRefused: what the job raises before it starts

    def defaults(self) -> Any:
        return self.settings_type()

    def preset(self, name: str) -> Any:
        return self.make_preset(name)

    label = staticmethod(setting_label)
    text = staticmethod(setting_text)

    def settings(self, typed: Mapping[str, str | bool]) -> Any:
        """The settings from what a user typed per field (ValueError naming a bad one); a
        field left out keeps its default."""
        fields = {f.name: f for f in dataclasses.fields(self.settings_type)}
        unknown = sorted(set(typed) - set(fields))
        if unknown:
            raise ValueError(f"no such setting: {', '.join(unknown)}")
        return self.settings_type(**{name: parse_setting(fields[name], value)
                                     for name, value in typed.items()})


def _caption_tool() -> PrepTool:
    from modules.data.prep.caption import PRESETS, CaptionSettings, caption_folder, \
        preset_settings
    from modules.data.prep.job import JobHooks, JobRefused
    return PrepTool("caption", "Caption images", CaptionSettings,
                    {name: p.summary for name, p in PRESETS.items()},
                    lambda name: preset_settings(name),
                    lambda folder, settings, hooks, stop: caption_folder(folder, settings,
                                                                         hooks, stop),
                    JobHooks, JobRefused)


def _mask_tool() -> PrepTool:
    from modules.data.prep.job import JobHooks, JobRefused
    from modules.data.prep.masks_job import MASK_PRESETS, MaskForm, make_masks, mask_preset
    return PrepTool("mask", "Make masks", MaskForm,
                    {name: summary for name, (summary, _values) in MASK_PRESETS.items()},
                    mask_preset,
                    lambda folder, form, hooks, stop: make_masks(folder, form.settings(),
                                                                 hooks, stop),
                    JobHooks, JobRefused)


# The tools in the order a window offers them: the button that opens each, and its row, built
# on first use (the caption and mask modules import torch and the models' libraries).
TOOL_ROWS: dict[str, tuple[str, Callable[[], PrepTool]]] = {
    "caption": ("Caption images…", _caption_tool),
    "mask": ("Make masks…", _mask_tool),
}


def prep_actions() -> dict[str, str]:
    """Each tool's button text, by key (no import of a tool's module)."""
    return {key: action for key, (action, _make) in TOOL_ROWS.items()}


def prep_tool(key: str) -> PrepTool:
    return TOOL_ROWS[key][1]()
