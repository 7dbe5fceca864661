"""The GUI's one Config object and the typed get/set-by-dotted-path layer over it.

Widgets never hold settings of their own: they write text or values here, this parses them by
the field's type (the same bounds the loader checks) and records a per-field error when the
text does not fit. No tkinter here, so all of it is testable without a window.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from enum import Enum
from typing import Any

from modules.config import Config, ConfigError, Problem, from_dict, to_dict, validate
from modules.frontend import check
from app.fields import FieldInfo, field_map, iter_fields

_INDEX = re.compile(r"\[(\d+)\]")


def enum_class(info: FieldInfo) -> type[Enum]:
    """The Enum of an enum or list-of-enum field."""
    if info.enum_type is None:
        raise TypeError(f"{info.dotted_path} is a {info.kind} field, not an enum")
    return info.enum_type


class FieldError(ValueError):
    """Text that does not fit a field: what was expected and what was given."""

    def __init__(self, expected: str, given: str) -> None:
        self.expected, self.given = expected, given
        super().__init__(f"expected {expected}, got {given}")


def split_path(path: str) -> list[str | int]:
    """'data.datasets[0].path' -> ['data', 'datasets', 0, 'path']."""
    parts: list[str | int] = []
    for segment in path.split("."):
        name = _INDEX.sub("", segment)
        if name:
            parts.append(name)
        parts.extend(int(i) for i in _INDEX.findall(segment))
    return parts


def schema_path(path: str) -> str:
    """The schema path of a concrete path: 'data.datasets[3].path' -> 'data.datasets[].path'."""
    return _INDEX.sub("[]", path)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _bounds_text(meta: dict) -> str:
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f" between {_number(lo)} and {_number(hi)}"
    if lo is not None:
        return f" of at least {_number(lo)}"
    if hi is not None:
        return f" of at most {_number(hi)}"
    return ""


def _check_bounds(value: float, meta: dict, what: str, text: str) -> None:
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise FieldError(what + _bounds_text(meta), repr(text))


def parse_text(info: FieldInfo, text: str) -> Any:
    """Turn widget text into the field's value; FieldError when it does not fit."""
    meta, stripped = info.metadata, text.strip()
    if info.kind == "int":
        try:
            value = int(stripped)
        except ValueError:
            raise FieldError("a whole number" + _bounds_text(meta), repr(text)) from None
        _check_bounds(value, meta, "a whole number", text)
        return value
    if info.kind in ("float", "optional_float"):
        if info.kind == "optional_float" and stripped == "":
            return None
        what = "a number" + (" (or empty)" if info.kind == "optional_float" else "")
        try:
            number = float(stripped)
        except ValueError:
            raise FieldError(what + _bounds_text(meta), repr(text)) from None
        if not math.isfinite(number):
            raise FieldError(what + _bounds_text(meta), repr(text))
        _check_bounds(number, meta, what, text)
        return number
    if info.kind in ("str", "path"):
        return text
    if info.kind == "list_str":
        separator = "\n" if meta.get("multiline") else ","
        return [item.strip() for item in text.split(separator) if item.strip()]
    if info.kind == "list_int":
        numbers = []
        for item in filter(None, (t.strip() for t in text.split(","))):
            try:
                numbers.append(int(item))
            except ValueError:
                raise FieldError("whole numbers separated by commas, e.g. 512, 768",
                                 repr(item)) from None
        return numbers
    if info.kind in ("enum", "list_enum"):
        enum_type = enum_class(info)
        names = [t.strip() for t in (text.split(",") if info.kind == "list_enum" else [text])]
        members = []
        for name in filter(None, names):
            match = [m for m in enum_type if m.value.lower() == name.lower()]
            if not match:
                raise FieldError("one of " + ", ".join(m.value for m in enum_type), repr(name))
            members.append(match[0])
        return members if info.kind == "list_enum" else members[0]
    if info.kind == "bool":
        low = stripped.lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise FieldError("true or false", repr(text))
    raise FieldError(f"a value for a {info.kind} field", repr(text))


def format_value(info: FieldInfo, value: Any) -> str:
    """The text a widget shows for a value (the inverse of `parse_text`)."""
    if value is None:
        return ""
    if isinstance(value, Enum):
        return value.value
    if info.kind == "list_str":
        return ("\n" if info.metadata.get("multiline") else ", ").join(value)
    if info.kind == "list_enum":
        return ", ".join(v.value for v in value)
    if info.kind == "list_int":
        return ", ".join(str(v) for v in value)
    if isinstance(value, float):
        return repr(value) if abs(value) >= 1e-4 or value == 0 else f"{value:g}"
    return str(value)


Listener = Callable[[str | None, object | None], None]


class ConfigBinding:
    """Holds the GUI's Config; set/get by dotted path; per-field errors; change listeners."""

    def __init__(self, config: Config | None = None) -> None:
        self.config = config if config is not None else Config()
        self.errors: dict[str, FieldError] = {}
        self.fields = field_map(Config)
        self._listeners: list[Listener] = []

    # --- reading -------------------------------------------------------------------------
    def info(self, path: str) -> FieldInfo:
        """FieldInfo for a concrete path, including list items ('data.datasets[0].path')."""
        parts = split_path(path)
        for i, part in enumerate(parts):
            if isinstance(part, int):
                head = schema_path(path).split("[]")[0]
                list_info = self.fields[head]
                rest = ".".join(str(p) for p in parts[i + 1:])
                item_fields = field_map(list_info.item_type)
                return item_fields[rest]
        return self.fields[path]

    def get(self, path: str) -> Any:
        value: Any = self.config
        for part in split_path(path):
            value = value[part] if isinstance(part, int) else getattr(value, part)
        return value

    def text(self, path: str) -> str:
        return format_value(self.info(path), self.get(path))

    # --- writing -------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        """listener(path, source) after a change; path None means 'everything changed'."""
        self._listeners.append(listener)

    def _notify(self, path: str | None, source: object | None) -> None:
        for listener in list(self._listeners):
            listener(path, source)

    def _assign(self, path: str, value: Any) -> None:
        parts = split_path(path)
        owner: Any = self.config
        for part in parts[:-1]:
            owner = owner[part] if isinstance(part, int) else getattr(owner, part)
        last = parts[-1]
        if isinstance(last, int):
            owner[last] = value
        else:
            setattr(owner, last, value)

    def set_value(self, path: str, value: Any, source: object | None = None) -> None:
        """Set an already typed value (checkbox, option menu) and clear the field's error."""
        self._assign(path, value)
        self.errors.pop(path, None)
        self._notify(path, source)

    def set_text(self, path: str, text: str, source: object | None = None) -> FieldError | None:
        """Parse widget text by the field's type; on failure keep the error (shown at the field)."""
        try:
            value = parse_text(self.info(path), text)
        except FieldError as error:
            self.errors[path] = error
            self._notify(path, source)
            return error
        self.set_value(path, value, source)
        return None

    def replace(self, config: Config) -> None:
        """Load a whole new config (a preset): every error is dropped, every widget refreshes."""
        self.config = config
        self.errors.clear()
        self._notify(None, None)

    def add_list_item(self, path: str) -> int:
        """Append a default item to a list-of-objects field, its path fields empty (the user
        names the folder: a dataset's default, the toy set builtin:shapes, cleared the "no
        dataset" problem and trained SDXL on 64 px shapes); returns its index."""
        item_type = self.info(path).item_type
        item = item_type()
        for sub in iter_fields(item_type):
            if sub.kind == "path" and "." not in sub.dotted_path:
                setattr(item, sub.dotted_path, "")
        items = self.get(path)
        items.append(item)
        self._notify(path, None)
        return len(items) - 1

    def remove_list_item(self, path: str, index: int) -> None:
        """Remove one item; errors of that list's rows are dropped (rows show config values again)."""
        del self.get(path)[index]
        for key in [k for k in self.errors if k.startswith(path + "[")]:
            del self.errors[key]
        self._notify(path, None)

    # --- checking ------------------------------------------------------------------------
    def field_problems(self) -> list[Problem]:
        """What the form holds that no config can: text that does not parse (not applied),
        and values the loader refuses, as it would in a preset file (a W&B API key pasted
        into a field). Save, Start and every check stop on these, listed, before they copy
        the config (`snapshot` raises on the second)."""
        unparsable = [Problem(path, err.expected, err.given,
                              "not applied: fix the text in this field")
                      for path, err in sorted(self.errors.items())]
        try:
            from_dict(to_dict(self.config))
        except ConfigError as exc:
            return unparsable + exc.problems
        return unparsable

    def problems(self, check_files: bool = True, config: Config | None = None) -> list[Problem]:
        """The form's `field_problems` first, then the `validate(config)` the CLI also runs,
        and (with check_files) the checks of the model, datasets and output folder a start
        runs, of `config` (default: the form's). A check that refuses by raising ConfigError
        is listed like the others: a refusal never reaches only the terminal."""
        config = self.config if config is None else config
        try:
            checked = check(config) if check_files else validate(config)
        except ConfigError as exc:
            checked = exc.problems
        return self.field_problems() + checked

    def snapshot(self) -> Config:
        """An independent copy (the worker trains on this while the GUI stays editable)."""
        return from_dict(to_dict(self.config))


def leaf_paths(config: Config) -> list[str]:
    """Every concrete widget path for a config, list items expanded ('data.datasets[0].path')."""
    paths = []
    for info in iter_fields(Config):
        paths.append(info.dotted_path)
        if info.kind == "list_dataclass":
            items: Any = config
            for part in info.dotted_path.split("."):  # a schema path: no list indices
                items = getattr(items, part)
            for i in range(len(items)):
                for sub in iter_fields(info.item_type):
                    paths.append(f"{info.dotted_path}[{i}].{sub.dotted_path}")
    return paths


__all__ = ["ConfigBinding", "FieldError", "format_value", "leaf_paths", "parse_text",
           "schema_path", "split_path"]
