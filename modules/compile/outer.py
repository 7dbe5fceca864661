"""Code run around a compiled block's call, outside its compiled code.

nn.Module.compile compiles ``_call_impl``, which runs the module's forward hooks: a hook that moves
weights between devices would be traced into the block's graph (and break it). An `OuterCall`
stands in for the module's ``_compiled_call_impl`` instead, so it runs in plain Python around
whatever call the module makes (its compiled code, or eager ``_call_impl``). The compile engine
keeps an `OuterCall` it finds in place and sets its ``inner`` (compile/applier.py): compiling,
falling back and undoing never drop it. Block offload (train/memory/offload.py) is its user.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class OuterCall:
    """Stands in for ``module._compiled_call_impl``; `around` is what subclasses run."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.inner: Callable[..., Any] | None = None  # the compiled call; None = eager

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own call: its compiled code when compiled, else ``_call_impl``."""
        return (self.inner or self.module._call_impl)(*args, **kwargs)

    def around(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.around(*args, **kwargs)


def set_compiled_call(module: nn.Module, compiled: Callable[..., Any] | None) -> None:
    """Make ``compiled`` (None: eager) the module's call, inside its `OuterCall` if it has one."""
    outer = module._compiled_call_impl
    if isinstance(outer, OuterCall):
        outer.inner = compiled
    else:
        module._compiled_call_impl = compiled


def install_outer_call(module: nn.Module, outer: OuterCall) -> None:
    """Put ``outer`` around the module's call, keeping the call it had (compiled or not)."""
    previous = module._compiled_call_impl
    if isinstance(previous, OuterCall):
        raise RuntimeError(f"{type(module).__name__} already has an outer call")
    outer.inner = previous
    module._compiled_call_impl = outer


def remove_outer_call(module: nn.Module) -> None:
    """Take the module's `OuterCall` away, leaving its inner call."""
    outer = module._compiled_call_impl
    if isinstance(outer, OuterCall):
        module._compiled_call_impl = outer.inner
