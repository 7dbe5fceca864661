"""The settings fields of the preparation jobs: each carries its help (the window's tooltip,
the command line's --help) and, for a choice, its choices (modules/data/prep/tools.py reads
them to build a window)."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str, **extra: Any) -> Any:  # noqa: A002 - every DSL says help
    """A settings field with its help (a front end's tooltip and --help) and, for a choice,
    its ``choices``."""
    return field(default=default, metadata={"help": help, **extra})
