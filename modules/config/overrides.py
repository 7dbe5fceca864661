"""`--set dotted.key=value` overrides, parsed by the type of the field they name.

Examples: `training.max_steps=200`, `compile.backend=aot_eager`, `compile.unet=false`,
`sampling.prompts=["a cat", "a dog"]`, `training.lora_target_modules=to_q,to_v`,
`data.datasets[0].path=./images`, `components.unet.learning_rate=none`.
Path values given on the command line are relative to the current folder.
"""
from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

from modules.config.loader import from_dict, resolve_path_value, to_dict
from modules.config.problems import ConfigError, Problem
from modules.config.schema import Config

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_SEGMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)((?:\[\d+\])*)$")


def _split_path(dotted: str) -> list[str | int] | None:
    """'data.datasets[0].path' -> ['data', 'datasets', 0, 'path']; None when malformed."""
    parts: list[str | int] = []
    for segment in dotted.split("."):
        if segment.isdigit():
            parts.append(int(segment))
            continue
        match = _SEGMENT.match(segment)
        if not match:
            return None
        parts.append(match.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    return parts


def _field_at(parts: list[str | int]) -> tuple[Any, dict] | None:
    """The declared type and metadata of the field a path names, or None if it names none."""
    tp: Any = Config
    meta: dict = {}
    for part in parts:
        if isinstance(part, int):
            if typing.get_origin(tp) is not list:
                return None
            tp = typing.get_args(tp)[0]
            meta = {}
            continue
        if not dataclasses.is_dataclass(tp):
            return None
        fields = {f.name: f for f in dataclasses.fields(tp)}
        if part not in fields:
            return None
        tp, meta = typing.get_type_hints(tp)[part], dict(fields[part].metadata)
    return tp, meta


def _text_to_json(tp: Any, text: str) -> Any:
    """Turn command-line text into the JSON value the loader expects for type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if text.strip().lower() in ("", "none", "null"):
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _text_to_json(inner, text)
    if origin is list or dataclasses.is_dataclass(tp):
        if text.lstrip().startswith(("[", "{")):
            return json.loads(text)
        if origin is list:
            return [s.strip() for s in text.split(",") if s.strip()]
        return text
    if tp is bool:
        low = text.strip().lower()
        return True if low in _TRUE else False if low in _FALSE else text
    if tp in (int, float):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    if isinstance(tp, type) and issubclass(tp, Enum):
        return text.strip()
    return text


def _assign(data: Any, parts: list[str | int], value: Any) -> str | None:
    """Set data[parts...] = value in nested JSON data; return an error text if a step is missing."""
    for part in parts[:-1]:
        if isinstance(part, int):
            if not isinstance(data, list) or part >= len(data):
                return f"index {part} is out of range"
        data = data[part]
    last = parts[-1]
    if isinstance(last, int) and (not isinstance(data, list) or last >= len(data)):
        return f"index {last} is out of range"
    data[last] = value
    return None


def apply_overrides(config: Config, assignments: list[str], cwd: Path | None = None) -> Config:
    """A new Config with each `key=value` applied; every bad assignment reported at once."""
    data = to_dict(config)
    problems: list[Problem] = []
    cwd = Path.cwd() if cwd is None else Path(cwd)
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        key = key.strip()
        parts = _split_path(key) if sep else None
        found = _field_at(parts) if parts else None
        if not sep or found is None:
            problems.append(Problem(key or assignment, "dotted.key=value naming a config field",
                                    repr(assignment)))
            continue
        tp, meta = found
        try:
            value = _text_to_json(tp, text)
        except json.JSONDecodeError as exc:
            problems.append(Problem(key, "valid JSON", repr(text), exc.msg))
            continue
        if meta.get("path") and isinstance(value, str):
            value = resolve_path_value(value, cwd)
        error = _assign(data, parts, value)
        if error:
            problems.append(Problem(key, "an existing list item", repr(assignment), error))
    try:
        result = from_dict(data, source="--set")
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems, "--set")
    return result
