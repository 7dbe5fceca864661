"""Errors as the user sees them: one informative line, and what an error wraps."""
from __future__ import annotations

from collections.abc import Iterator


def first_line(err: BaseException) -> str:
    """The first informative line of an error's message, or its type's name when it has none.

    A first line that ends with ":" (dynamo's "backend='x' raised:") is joined with the next,
    which holds the cause.
    """
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def describe(err: BaseException) -> str:
    """``Type: first line`` for a log line or a status message."""
    return f"{type(err).__name__}: {first_line(err)}"


def error_chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and every exception it wraps (cause, context, dynamo's ``inner_exception``)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        todo.extend([current.__cause__, current.__context__,
                     getattr(current, "inner_exception", None)])


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is (or wraps) an out-of-memory error of the GPU or the host."""
    import torch

    return any(isinstance(e, (torch.OutOfMemoryError, MemoryError))
               or "out of memory" in str(e).lower() for e in error_chain(err))
