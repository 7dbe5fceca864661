"""Dynamo backends that fail on purpose, for the compile-fallback tests (CPU and GPU)."""
from __future__ import annotations

_COUNTERS: dict[str, dict[str, int]] = {}


def register_failing_after_first(name: str, message: str) -> dict[str, int]:
    """Register backend `name`: its first compile works (eager kernels), every later one raises
    RuntimeError(message). Returns its compile counter (reset it by setting "count" to 0);
    registering a name again returns the same counter, as dynamo keeps the first function."""
    import torch._dynamo

    if name in _COUNTERS:
        return _COUNTERS[name]
    compiles = _COUNTERS[name] = {"count": 0}

    def second_fails(gm, example_inputs):
        compiles["count"] += 1
        if compiles["count"] > 1:
            raise RuntimeError(message)
        return gm.forward

    if name not in torch._dynamo.list_backends(exclude_tags=None):
        torch._dynamo.register_backend(compiler_fn=second_fails, name=name)
    return compiles
