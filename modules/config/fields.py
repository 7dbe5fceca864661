"""Field declaration helper: every config field carries its GUI/CLI/docs metadata in one place."""
from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any


class OnResume(str, Enum):
    """What resuming a backup with another value of a field does (`on_resume` metadata).

    Declared on a section (it then holds for every field in it) or on one field (the exception
    inside its section); a field that declares nothing, in a section that declares nothing, may
    change.
    """
    MUST_MATCH = "must_match"  # changes the math of what a backup holds: the resume is refused
    MAY_CHANGE = "may_change"  # a speed, memory or loading switch: the resume lists it, and goes on
    IGNORED = "ignored"        # where the run is written and how it is resumed: not mentioned


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,  # noqa: A002 - the field's help text: the word every config DSL uses
    label: str,
    group: str,
    default_factory: Any = dataclasses.MISSING,
    min: float | None = None,  # noqa: A002 - the field's bounds, read as metadata keys
    max: float | None = None,  # noqa: A002
    path: bool = False,
    advanced: bool = False,
    multiline: bool = False,
    files: tuple[str, ...] = (),
    on_resume: OnResume | None = None,
    compile_check: bool | None = None,
) -> Any:
    """Declare a config field once: default, help text, GUI label and tab, and value bounds.

    `path=True` marks a filesystem path that is resolved relative to the config file's folder
    (a value starting with ``builtin:`` names something Tempera builds locally instead).
    `files` (with `path=True`): the path may also be a file matching these patterns, so the GUI
    offers a file chooser next to the folder chooser.
    `on_resume`: see `OnResume`. `compile_check=True`: a compilation check depends on this field
    (or section), so changing it makes the check's report outdated. Both are inherited from the
    enclosing section when the field leaves them None (`introspect.rule_at`).
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
        "on_resume": on_resume,
        "compile_check": compile_check,
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
