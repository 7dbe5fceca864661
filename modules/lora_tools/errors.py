"""A LoRA tool's refusal, naming the input that is wrong by its field key, so that each front
end says it in its own words: `tempera-lora` by its flag (`--output`), the window by the
field's label (*Output*). Torch-free: the window imports it before torch.

An error about an input is made from a template with the input as a placeholder, e.g.
`input_error("{output} {path}: already exists", path=path)`; `text(names)` fills each input's
placeholder with the front end's name for it and the other placeholders with their values.
"""
from __future__ import annotations

import string
from collections.abc import Mapping

# The inputs a tool reads (the keyword arguments of `operations.run_tool`), which a template
# may name; str() of an error names them by these keys.
INPUTS = ("base", "model_type", "config_folder", "cache_dir", "loras", "tuned", "rank",
          "conv_rank", "threshold", "layout", "output")


class LoraToolError(ValueError):
    """Input a LoRA tool cannot use, with the file or input named and what to do.

    A plain message names no input by a front end's word; one made by `input_error` names its
    inputs (`fields`, first the one to change) and renders in each front end's words
    (`text`)."""

    def __init__(self, message: str, *, template: str | None = None,
                 values: Mapping[str, object] | None = None) -> None:
        self.template = template
        self.values = dict(values or {})
        self.fields: tuple[str, ...] = _inputs_named(template) if template else ()
        super().__init__(message)

    def text(self, names: Mapping[str, str]) -> str:
        """The message with each input named as `names` says (a front end's flags or labels;
        an input missing from `names` keeps its key)."""
        if self.template is None:
            return str(self)
        return _fill(self.template, self.values, names)


def input_error(template: str, **values: object) -> LoraToolError:
    """A LoraToolError about the inputs `template` names as `{output}`, `{rank}`, … (INPUTS);
    its other placeholders are filled from `values`, formatted as `str.format` formats them."""
    clash = sorted(set(values) & set(INPUTS))
    if clash:
        raise TypeError(f"input_error: {', '.join(clash)} name inputs, not values")
    unknown = [name for name in _placeholders(template) if name not in INPUTS
               and name not in values]
    if unknown:
        raise TypeError(f"input_error: no value for {', '.join(unknown)}")
    return LoraToolError(_fill(template, values, {}), template=template, values=values)


def _fill(template: str, values: Mapping[str, object], names: Mapping[str, str]) -> str:
    return template.format_map({**{key: names.get(key, key) for key in INPUTS}, **values})


def _placeholders(template: str) -> list[str]:
    """The names of a format template's placeholders (`{rank!r}`, `{path.name}` -> rank, path)."""
    found = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field:
            found.append(field.split(".")[0].split("[")[0])
    return found


def _inputs_named(template: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for name in _placeholders(template) if name in INPUTS))
