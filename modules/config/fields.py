"""Field declaration helper: every config field carries its GUI/CLI/docs metadata in one place."""
from __future__ import annotations

import dataclasses
from typing import Any


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    label: str,
    group: str,
    default_factory: Any = dataclasses.MISSING,
    min: float | None = None,
    max: float | None = None,
    path: bool = False,
    advanced: bool = False,
    multiline: bool = False,
    files: tuple[str, ...] = (),
) -> Any:
    """Declare a config field once: default, help text, GUI label and tab, and value bounds.

    `path=True` marks a filesystem path that is resolved relative to the config file's folder
    (a value starting with ``builtin:`` names something Tempera builds locally instead).
    `files` (with `path=True`): the path may also be a file matching these patterns, so the GUI
    offers a file chooser next to the folder chooser.
    """
    metadata = {
        "help": help,
        "label": label,
        "group": group,
        "min": min,
        "max": max,
        "path": path,
        "advanced": advanced,
        "multiline": multiline,
        "files": tuple(files),
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
