"""Strict loading and saving of the config tree.

Every problem in a file is reported at once with its dotted path, what was expected and what was
given. Loading runs the ordered migrations first, so older files keep working.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

from modules.config.introspect import type_hints
from modules.config.migrations import migrate
from modules.config.problems import ConfigError, Problem
from modules.config.schema import BUILTIN_PREFIX, Config
from modules.config.wandb_settings import wandb_key_problems
from modules.util.atomic import atomic_write_text
from modules.util.secrets import SECRET_NAME


def _describe(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, Enum) else value.value
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(m.value for m in tp)
    if dataclasses.is_dataclass(tp):
        return "an object"
    origin = typing.get_origin(tp)
    if origin is list:
        return f"a list of {_item_name(typing.get_args(tp)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp))


def _item_name(tp: Any) -> str:
    """How one item of a list type reads in a message ("a list of strings")."""
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "values from " + ", ".join(m.value for m in tp)
    if dataclasses.is_dataclass(tp):
        return "objects"
    return {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}.get(
        tp, str(tp))


def _check_range(value: float, meta: dict, path: str, problems: list[Problem]) -> None:
    """Append a Problem when `value` is outside the field's min/max (either may be absent)."""
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is not None and hi is not None:
            expected = f"a value between {_num(lo)} and {_num(hi)}"
        elif lo is not None:
            expected = f"a value of at least {_num(lo)}"
        else:
            assert hi is not None  # no minimum, so the value broke the maximum
            expected = f"a value of at most {_num(hi)}"
        problems.append(Problem(path, expected, _describe(value)))


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _parse(tp: Any, value: Any, path: str, meta: dict, problems: list[Problem]) -> Any:
    """Convert a JSON value to `tp`, appending a Problem (and returning None) when it does not fit."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        inner_problems: list[Problem] = []
        parsed = _parse(inner, value, path, meta, inner_problems)
        # A value of the wrong type should hear that null is allowed too; range problems stay.
        problems += [dataclasses.replace(p, expected=_type_name(tp))
                     if p.path == path and p.expected == _type_name(inner) else p
                     for p in inner_problems]
        return parsed
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(Problem(path, "an object", _describe(value)))
            return None
        return _build(tp, value, path, problems)
    if origin is list:
        if not isinstance(value, list):
            problems.append(Problem(path, _type_name(tp), _describe(value)))
            return None
        (item_tp,) = typing.get_args(tp)
        return [_parse(item_tp, v, f"{path}[{i}]", {}, problems) for i, v in enumerate(value)]
    if isinstance(tp, type) and issubclass(tp, Enum):
        if isinstance(value, str):
            for member in tp:
                if member.value.lower() == value.lower():
                    return member
        problems.append(Problem(path, _type_name(tp), _describe(value)))
        return None
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            _check_range(value, meta, path, problems)
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # Python's json accepts NaN and Infinity, and NaN passes every range comparison.
            if not math.isfinite(value):
                problems.append(Problem(path, "a finite number", _describe(value)))
                return None
            _check_range(value, meta, path, problems)
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    problems.append(Problem(path, _type_name(tp), _describe(value)))
    return None


def closest_key(key: str, known: list[str]) -> str | None:
    """The known key an unknown `key` was probably meant to be, for a "did you mean" hint. None
    for a name that says it holds a secret (`wandb_api_key`): a hint would invite pasting the
    secret into a field the config keeps and records."""
    if SECRET_NAME.search(key):
        return None
    close = difflib.get_close_matches(key, known, n=1)
    return close[0] if close else None


def _build(cls: type, data: dict, prefix: str, problems: list[Problem]) -> Any:
    hints = type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            if any(p.path == path for p in problems):  # refused already (a W&B key entry)
                continue
            close = closest_key(key, list(fields))
            hint = f"did you mean '{close}'?" if close else ""
            problems.append(Problem(path, "a known key (" + ", ".join(fields) + ")",
                                    f"unknown key '{key}'", hint))
            continue
        parsed = _parse(hints[key], value, path, dict(fields[key].metadata), problems)
        if parsed is not None or value is None:
            kwargs[key] = parsed
    return cls(**kwargs)


def from_dict(data: dict, source: str = "config") -> Config:
    """Build a Config from (possibly sparse) JSON data; raise ConfigError with every problem."""
    if not isinstance(data, dict):
        raise ConfigError([Problem("(top level)", "a JSON object", _describe(data))], source)
    problems: list[Problem] = wandb_key_problems(data)
    data = migrate(data, problems)
    config = _build(Config, data, "", problems)
    if problems:
        raise ConfigError(problems, source)
    return config


def to_dict(config: Any) -> dict:
    """The config as plain JSON data (enums as their names), every field present."""
    def convert(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: convert(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, list):
            return [convert(v) for v in value]
        if isinstance(value, Enum):
            return value.value
        return value
    return convert(config)


def sparse_dict(config: Config) -> dict:
    """Only the keys whose values differ from the defaults (what presets store)."""
    def diff(current: Any, default: Any) -> Any:
        if isinstance(current, dict) and isinstance(default, dict):
            out = {k: diff(v, default.get(k)) for k, v in current.items()}
            out = {k: v for k, v in out.items() if v is not _SAME}
            return out or _SAME
        return _SAME if current == default else current
    result = diff(to_dict(config), to_dict(Config()))
    result = {} if result is _SAME else result
    result["config_version"] = config.config_version
    return result


_SAME = object()


def read_json(path: Path) -> Any:
    """Read a JSON file; a missing or malformed file becomes a ConfigError naming it precisely."""
    try:
        # utf-8-sig: editors such as Windows Notepad may start the file with a byte-order mark.
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ConfigError([Problem("(file)", "an existing config file", str(path),
                                   "no such file")], str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Problem("(file)", "a readable UTF-8 file", f"{path} ({exc})")],
                          str(path)) from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([Problem("(file)", "valid JSON",
                                   f"{exc.msg} at line {exc.lineno} column {exc.colno}")],
                          str(path)) from exc


def load_config(path: Path | str) -> Config:
    """Load a config file strictly and resolve its relative paths against the file's folder."""
    path = Path(path)
    config = from_dict(read_json(path), source=str(path))
    return resolve_paths(config, path.resolve().parent)


def save_config(config: Config, path: Path | str, sparse: bool = False) -> None:
    """Write the config as JSON atomically (a crash never leaves a truncated file)."""
    data = sparse_dict(config) if sparse else to_dict(config)
    atomic_write_text(Path(path), json.dumps(data, indent=2) + "\n")


def path_fields(config: Any, prefix: str = "") -> list[tuple[Any, str, str]]:
    """Every (owner object, attribute name, dotted path) whose field is marked `path=True`."""
    found = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        if f.metadata.get("path"):
            found.append((config, f.name, dotted))
        elif dataclasses.is_dataclass(value):
            found.extend(path_fields(value, dotted))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    found.extend(path_fields(item, f"{dotted}[{i}]"))
    return found


def resolve_path_value(value: str, base_dir: Path) -> str:
    """A path relative to `base_dir` made absolute (`~` and `{data}`, the user's data folder,
    expanded); empty and builtin values stay as they are."""
    from modules.paths import expand_data_placeholder
    if not value or value.startswith(BUILTIN_PREFIX):
        return value
    expanded = Path(expand_data_placeholder(value)).expanduser()
    return str(expanded if expanded.is_absolute() else (base_dir / expanded).resolve())


def resolve_paths(config: Config, base_dir: Path) -> Config:
    """A copy of the config with every relative path made absolute against `base_dir`."""
    config = from_dict(to_dict(config))
    for owner, name, _ in path_fields(config):
        setattr(owner, name, resolve_path_value(getattr(owner, name), Path(base_dir)))
    return config


def relativize_paths(config: Config, base_dir: Path, root: Path | None = None) -> Config:
    """A copy with paths inside `root` (default `base_dir`) written relative to `base_dir`
    (portable presets; a training repository's configs, whose `root` is the repository)."""
    config = from_dict(to_dict(config))
    base = Path(base_dir).resolve()
    inside = Path(root).resolve() if root is not None else base
    for owner, name, _ in path_fields(config):
        value = getattr(owner, name)
        if value and not value.startswith(BUILTIN_PREFIX) and Path(value).is_absolute():
            if Path(value).resolve().is_relative_to(inside):
                setattr(owner, name, os.path.relpath(Path(value).resolve(), base))
    return config
