"""Walk the config schema: every leaf field with its dotted path, type, default, metadata and kind.

The docs generator (`modules/config/docs.py`) and the GUI's form both read the schema through
`iter_fields`, so a field added to `schema.py` shows up in both without being listed again.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

KINDS = ("bool", "int", "float", "str", "enum", "path", "list_str", "list_int", "list_enum",
         "optional_float", "list_dataclass")


@dataclass(frozen=True)
class FieldInfo:
    """One leaf field of the schema, as the docs and the GUI need it."""

    dotted_path: str
    type: Any
    default: Any
    metadata: dict
    kind: str

    @property
    def name(self) -> str:
        return self.dotted_path.rsplit(".", 1)[-1]

    @property
    def parent(self) -> str:
        return self.dotted_path.rpartition(".")[0]

    @property
    def label(self) -> str:
        return self.metadata.get("label") or self.name

    @property
    def help(self) -> str:
        return self.metadata.get("help", "")

    @property
    def group(self) -> str:
        return self.metadata.get("group", "General")

    @property
    def advanced(self) -> bool:
        return bool(self.metadata.get("advanced"))

    @property
    def item_type(self) -> Any:
        """The element type of a list field (None for other kinds)."""
        if typing.get_origin(self.type) is list:
            return typing.get_args(self.type)[0]
        return None

    @property
    def enum_type(self) -> type[Enum] | None:
        """The Enum class of an enum or list-of-enum field (None for other kinds)."""
        if self.kind == "enum":
            return self.type
        if self.kind == "list_enum":
            return self.item_type
        return None


def _is_enum(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Enum)


def kind_of(tp: Any, metadata: dict) -> str | None:
    """The kind (one of KINDS) of a field type; None for a nested dataclass (a container).

    An unsupported type raises TypeError, so a schema change the docs and GUI cannot show
    fails the docs test instead of silently disappearing from the form.
    """
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and inner[0] in (float, int):
            return "optional_float"
        raise TypeError(f"unsupported optional type {tp!r}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item):
            return "list_dataclass"
        if _is_enum(item):
            return "list_enum"
        if item is str:
            return "list_str"
        if item is int:
            return "list_int"
        raise TypeError(f"unsupported list type {tp!r}")
    if dataclasses.is_dataclass(tp):
        return None
    if _is_enum(tp):
        return "enum"
    if tp in (bool, int, float):
        return tp.__name__
    if tp is str:
        return "path" if metadata.get("path") else "str"
    raise TypeError(f"unsupported field type {tp!r}")


def iter_fields(cls: type, prefix: str = "", defaults: Any = None) -> Iterator[FieldInfo]:
    """Every leaf field of `cls`, recursing into nested dataclasses but not into list items.

    Defaults are read from a default instance (`cls()` unless `defaults` is given), so a field
    whose parent overrides it (`components.denoiser.train` is true, `ComponentConfig.train` is
    false) reports the value a new config really has. For the item fields of a
    `list_dataclass` field, call `iter_fields(info.item_type, f"{info.dotted_path}[]")`.
    """
    defaults = cls() if defaults is None else defaults
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        metadata = dict(f.metadata)
        default = getattr(defaults, f.name)
        kind = kind_of(tp, metadata)
        if kind is None:
            yield from iter_fields(tp, path, default)
        else:
            yield FieldInfo(path, tp, default, metadata, kind)


def container_labels(cls: type, prefix: str = "") -> dict[str, str]:
    """Dotted path of each nested dataclass field -> its label ("components.denoiser" -> "UNet")."""
    hints = type_hints(cls)
    labels: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            path = f"{prefix}.{f.name}" if prefix else f.name
            labels[path] = f.metadata.get("label", f.name)
            labels.update(container_labels(tp, path))
    return labels


def field_map(cls: type) -> dict[str, FieldInfo]:
    """dotted path -> FieldInfo for every leaf field of `cls`."""
    return {info.dotted_path: info for info in iter_fields(cls)}


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints(cls)`, resolved once per class: the schema does not change while
    the program runs, and the GUI asks `rule_at` on every keystroke (read only: do not
    modify the returned dict)."""
    return typing.get_type_hints(cls)


def rule_at(cls: type, dotted_path: str, key: str) -> Any:
    """The metadata `key` that holds for `dotted_path`: the field's own value, else the nearest
    enclosing section's (None when none declares it). List indices (`data.datasets[0].path`)
    are looked up in the list's item type; a path that leaves the schema (a key of another
    version) keeps what held where it left."""
    value, tp = None, cls
    for part in dotted_path.split("."):
        name = part.split("[", 1)[0]
        fields = {f.name: f for f in dataclasses.fields(tp)} if dataclasses.is_dataclass(tp) else {}
        if name not in fields:
            break
        if fields[name].metadata.get(key) is not None:
            value = fields[name].metadata[key]
        tp = type_hints(tp)[name]
        if typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
    return value


def on_resume(dotted_path: str) -> Any:
    """The `OnResume` rule of a config key (`components.denoiser.learning_rate`)."""
    from modules.config.fields import OnResume
    from modules.config.schema import Config
    return rule_at(Config, dotted_path, "on_resume") or OnResume.MAY_CHANGE


def outdates_compile_check(dotted_path: str) -> bool:
    """Whether changing this config key makes a compilation check's report outdated."""
    from modules.config.schema import Config
    return bool(rule_at(Config, dotted_path, "compile_check"))
