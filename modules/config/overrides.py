"""`--set dotted.key=value` overrides, parsed by the type of the field they name.

Examples: `training.max_steps=200`, `compile.backend=aot_eager`, `compile.denoiser=false`,
`sampling.prompts=["a cat", "a dog"]`, `training.lora_target_modules=to_q,to_v`,
`data.datasets[0].path=./images`, `components.denoiser.learning_rate=none`.
Keys a config migration renamed (`compile.unet`, `components.unet.*`) are accepted under their
old names too, as config files are.
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

from modules.config.introspect import type_hints
from modules.config.loader import (closest_key, from_dict, path_fields, resolve_path_value,
                                   to_dict)
from modules.config.migrations import renamed_key
from modules.config.problems import ConfigError, Problem
from modules.config.schema import Config
from modules.util.secrets import SECRET_NAME

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
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            return None
        fields = {f.name: f for f in dataclasses.fields(tp)}
        if part not in fields:
            return None
        tp, meta = type_hints(tp)[part], dict(fields[part].metadata)
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
            items = [s.strip() for s in text.split(",") if s.strip()]
            # whole numbers as numbers (data.resolutions=512,768); other text stays for the
            # loader to report against the field
            return ([int(s) if s.lstrip("-").isdigit() else s for s in items]
                    if typing.get_args(tp)[0] is int else items)
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
    """Set data[parts...] = value in nested JSON data; return an error text if a step is missing.

    An earlier `--set` may have replaced a list or object with a value of another shape, so each
    step checks what it indexes instead of trusting the schema.
    """
    for i, part in enumerate(parts):
        where = _dotted(parts[:i]) or "the config"
        if isinstance(part, int):
            if not isinstance(data, list):
                return f"{where} is not a list"
            if part >= len(data):
                return f"index {part} is out of range; {where} has {len(data)} item(s)"
        elif not isinstance(data, dict):
            return f"{where} is not an object"
        if i == len(parts) - 1:
            data[part] = value
            return None
        data = data[part]
    return None


def _dotted(parts: list[str | int]) -> str:
    """['data', 'datasets', 0, 'path'] -> 'data.datasets[0].path'."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _all_keys(cls: Any = Config, prefix: str = "") -> list[str]:
    """Every dotted key `--set` accepts (list items as `name[0]`), for did-you-mean hints."""
    keys = []
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        keys.append(dotted)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += _all_keys(tp, dotted)
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            keys += _all_keys(typing.get_args(tp)[0], f"{dotted}[0]")
    return keys


def _unknown_key_problem(key: str, assignment: str) -> Problem:
    if "=" not in assignment:
        return Problem(key or assignment, "dotted.key=value", repr(assignment), "no '=' in it")
    close = closest_key(key, _all_keys())
    hint = f"did you mean '{close}'?" if close else "see docs/config.md for every key"
    given = repr(f"{key}=…") if SECRET_NAME.search(key) else repr(assignment)  # never echoed
    return Problem(key or assignment, "dotted.key=value naming a config field", given, hint)


def _within(dotted: str, prefix: str) -> bool:
    return dotted == prefix or dotted.startswith((prefix + ".", prefix + "["))


def apply_overrides(config: Config, assignments: list[str], cwd: Path | None = None) -> Config:
    """A new Config with each `key=value` applied; every bad assignment reported at once.

    Path values given here (also inside a JSON object such as `data.datasets=[{"path": "x"}]`)
    are resolved against `cwd` (default: the current folder), not against the config file.
    """
    data = to_dict(config)
    problems: list[Problem] = []
    cwd = Path.cwd() if cwd is None else Path(cwd)
    assigned: list[str] = []
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        key = renamed_key(key.strip())
        parts = _split_path(key) if sep else None
        found = _field_at(parts) if parts else None
        if parts is None or found is None:  # parts is None when there is no `=`
            problems.append(_unknown_key_problem(key, assignment))
            continue
        tp, _ = found
        try:
            value = _text_to_json(tp, text)
        except json.JSONDecodeError as exc:
            problems.append(Problem(key, "valid JSON", repr(text),
                                    f"{exc.msg} at column {exc.colno}"))
            continue
        error = _assign(data, parts, value)
        if error:
            problems.append(Problem(key, "an existing list item or object", repr(assignment),
                                    error))
            continue
        assigned.append(_dotted(parts))
    try:
        result = from_dict(data, source="--set")
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems, "--set")
    for owner, name, dotted in path_fields(result):
        if any(_within(dotted, prefix) for prefix in assigned):
            setattr(owner, name, resolve_path_value(getattr(owner, name), cwd))
    return result
