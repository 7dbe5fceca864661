"""Dynamo backends that fail on purpose, for the compile-fallback tests (CPU and GPU)."""
from __future__ import annotations

_COUNTERS: dict[str, dict] = {}  # per backend name: its counter or state


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


def register_recording_backend(name: str) -> dict:
    """Register backend `name`, a stand-in for CUDA graph trees on the CPU: its compiled code
    runs eagerly, and it "records" each input shape at the second call there (trees warm a new
    shape up first), with no dynamo compile when sizes are dynamic. Recording any shape but the
    first raises ``state["error"]()`` (a capture error or an out-of-memory). Returns the state;
    reset it with ``state["recorded"].clear()`` and ``state["calls"].clear()``."""
    import torch
    import torch._dynamo

    if name in _COUNTERS:
        return _COUNTERS[name]
    state: dict = {"calls": {}, "recorded": [],
                   "error": lambda: RuntimeError("CUDA error: operation failed during capture")}
    _COUNTERS[name] = state

    def recording(gm, example_inputs, options=None):
        def run(*args):
            shape = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
            calls = state["calls"][shape] = state["calls"].get(shape, 0) + 1
            if calls == 2:
                if state["recorded"]:
                    raise state["error"]()
                state["recorded"].append(shape)
            return gm.forward(*args)
        return run

    if name not in torch._dynamo.list_backends(exclude_tags=None):
        torch._dynamo.register_backend(compiler_fn=recording, name=name)
    return state
