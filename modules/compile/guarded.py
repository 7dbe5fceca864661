"""The guarded window: micro-steps run so that a compile failure falls back and is undone.

Compilation is lazy: ``torch.compile`` returns at once and the real work (and most failures)
happen inside a forward or backward, at the first step and again whenever a new shape, a new
bucket or a short last batch makes dynamo compile. So the trainer runs every micro-step of an
optimizer step through a `GuardedWindow`. A call is guarded when a compile happened during it,
when a compiled component is still in its first calls after a compile (CUDA graphs warm up
and record there), or when its batch shape is in its first calls since the compiled code was
built: CUDA graph trees record one graph per shape, on the second call at that shape, without
any dynamo compile (dynamic sizes). A failure in a guarded call moves the failing component one
backend down the chain (TRITON -> INDUCTOR -> DEFAULT -> AOT_EAGER -> NONE), resets the
gradients to their state at the window's start (clear: the optimizer has just zeroed them) and
the random state, and replays every micro-step of the window with the same batches and
pre-drawn noise. Nothing is copied, no step is lost and none is counted twice, because the
trainer calls ``optimizer.step()`` only after the window's last micro-step returned.

An out-of-memory error is not a compile failure: it propagates unchanged unless it was raised
while compiling (autotuning, for example), or while a CUDA-graphed component may be recording
(its graph pools hold memory of their own, which the next backend down does not need). Before
the retry, the failed attempt's cached GPU memory is released (`release_device_memory`).

`FallbackGuard` holds what lasts across windows (calls so far, calls per batch shape) and owns
the fallback; `GuardedWindow` is one optimizer step's micro-steps.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from modules.compile.applier import PlanApplier
from modules.compile.capabilities import Capabilities
from modules.compile.plan import CompileError, next_backend
from modules.compile.reporting import CompiledComponent, CompileReporter
from modules.compile.tracking import CompileTracker
from modules.util.errors import describe, first_line, is_out_of_memory
from modules.util.memory import release_device_memory

T = TypeVar("T")


class FallbackGuard:
    """Decides whether a failed call is a compile failure, and falls back when it is.

    ``params`` are the tensors whose ``.grad`` a failed attempt resets. A call is guarded for
    ``probation_steps`` calls after a compile and after a new batch shape.
    """

    def __init__(self, components: dict[str, CompiledComponent], applier: PlanApplier,
                 reporter: CompileReporter, tracker: CompileTracker, caps: Capabilities,
                 params: Iterable[torch.Tensor], strict: bool, probation_steps: int = 3):
        self.components = components
        self.applier = applier
        self.reporter = reporter
        self.tracker = tracker
        self.caps = caps
        self.params = list(params)
        self.strict = strict
        self.probation_steps = probation_steps
        self.calls = 0                      # successful guarded calls, all windows together
        self.new_shape = False              # the call in flight trains a shape not seen before
        self.shape_warming = False          # ... or one still in its first calls (begin_call)
        # successful calls per batch shape since the compiled code was last built (a fallback
        # rebuilds it: every shape compiles and records again)
        self.shape_calls: dict[Hashable, int] = {}
        # Why the window's micro-steps cannot be run again now ("" when they can): set by a
        # trainer whose micro-steps change state a replay would change twice (the fused
        # backward pass steps weights inside backward, modules/train/recipe/fused.py).
        self.replay_blocker: Callable[[], str] = lambda: ""

    @property
    def persistent_grads(self) -> bool:
        """Whether the trainer keeps gradients allocated and zeroes them in place."""
        return any(c.plan.persistent_grads for c in self.components.values())

    @property
    def cudagraphs(self) -> bool:
        return any(c.plan.cudagraphs for c in self.components.values())

    def recompile_expected(self) -> bool:
        """A recompile now belongs to warm-up or to a new input shape."""
        return self.calls < self.probation_steps or self.new_shape

    def begin_call(self, shape: Hashable | None) -> dict[str, int]:
        """Before a guarded call: its shape's warm-up state; the compile counts to compare."""
        self.tracker.last_failure = None
        seen = -1 if shape is None else self.shape_calls.get(shape, 0)
        self.new_shape = seen == 0
        # Cudagraph trees warm a new shape up on its first call and record it on the second;
        # the first replay after that is the first call that neither compiles nor records.
        self.shape_warming = 0 <= seen < self.probation_steps
        if self.cudagraphs:
            # Each micro-step is a new CUDA-graph generation: outputs of the previous one may
            # be overwritten from here on (the trainer keeps none of them).
            torch.compiler.cudagraph_mark_step_begin()
        return self.tracker.compile_counts()

    def compiled_since(self, before: dict[str, int]) -> set[str]:
        after = self.tracker.compile_counts()
        return {name for name, count in after.items() if count != before.get(name, 0)}

    def after_success(self, compiled_during: set[str], shape: Hashable | None) -> None:
        self.calls += 1
        self.new_shape = self.shape_warming = False
        if shape is not None:
            self.shape_calls[shape] = self.shape_calls.get(shape, 0) + 1
        for comp in self.components.values():
            if not comp.plan.compiled:
                continue
            compiled = comp.name in compiled_during
            comp.quiet_calls = 0 if compiled else comp.quiet_calls + 1
            self.reporter.after_call(comp, compiled)

    def suspects(self, compiled_during: set[str]) -> list[CompiledComponent]:
        """The compiled components a failure in this call may come from: those that compiled
        during it, are in their first calls after a compile, or see a batch shape still in its
        first calls (where CUDA graphs warm up and record, with no compile to tell)."""
        return [c for c in self.components.values() if c.plan.compiled
                and (c.name in compiled_during or c.quiet_calls < self.probation_steps
                     or self.shape_warming)]

    def failing(self, err: Exception, compiled_during: set[str]) -> list[CompiledComponent]:
        """The component(s) to fall back for ``err``; empty when it is not a compile failure."""
        suspects = self.suspects(compiled_during)
        if is_out_of_memory(err) and not self.tracker.raised_while_compiling(err):
            # Only a CUDA graph's recording may have caused it: the next backend down has no
            # graph pools. Any other out-of-memory would happen on every backend.
            return [c for c in suspects if c.plan.cudagraphs]
        named = [c for c in suspects if c.name == self.tracker.last_failure]
        return named or suspects

    def strict_error(self, failing: list[CompiledComponent], err: Exception) -> CompileError:
        names = ", ".join(f"{c.label} ({c.plan.effective.value})" for c in failing)
        return CompileError(f"compiling {names} failed and compile.strict is on: "
                            f"{type(err).__name__}: {first_line(err)}")

    def unreplayable_error(self, failing: list[CompiledComponent], err: Exception,
                           why: str) -> CompileError:
        names = ", ".join(f"{c.label} ({c.plan.effective.value})" for c in failing)
        return CompileError(f"compiling {names} failed part way through a step, and {why}: "
                            "running the step again on the next backend would apply those "
                            "updates twice, so the run stops here (set that component's "
                            f"compile.backend lower, or turn it off): {type(err).__name__}: "
                            f"{first_line(err)}")

    def fall_back(self, failing: list[CompiledComponent], reason: str) -> None:
        """Move ``failing`` one backend down; ``reason`` is the failure as one line (the caller
        holds no reference to the exception any more, so its tensors can be freed here)."""
        import torch._dynamo

        self.applier.undo()
        for comp in failing:
            old = comp.plan.effective
            self.applier.move_down(comp, next_backend(old, self.caps))
            stats = self.tracker.component(comp.name)
            stats.graphs = stats.calls_after_graph = 0  # "ran" is about the backend now in use
            self.reporter.fell_back(comp, old, reason)
        # Drop every compiled frame and guard so the retry compiles from scratch.
        torch._dynamo.reset()  # frees the compiled code and its CUDA graph pools too
        self.tracker.after_dynamo_reset()
        self.shape_calls.clear()  # every shape compiles (and records) again on the new backend
        release_device_memory()
        self.applier.compile_all()

    def clear_grads(self) -> None:
        """Gradients back to the window's start (clear), without copying anything."""
        persistent = self.persistent_grads
        for param in self.params:
            if param.grad is None:
                continue
            if persistent:
                param.grad.zero_()
            else:
                param.grad = None


class GuardedWindow:
    """The micro-steps of one optimizer step, run so that a compile failure can be undone.

    ``run(step_fn)`` runs one micro-step (forward + loss + backward, no optimizer step); its
    results are kept in ``results`` in order. ``step_fn`` must be repeatable: draw noise and
    timesteps outside it. On a compile failure every micro-step of the window so far is run
    again on the fallback backend, from clear gradients and the random state of the window's
    start, and ``results`` is rebuilt from that replay.
    """

    def __init__(self, guard: FallbackGuard):
        self.guard = guard
        self.steps: list[Callable[[], Any]] = []
        self.results: list[Any] = []
        self._rng = _RandomState.capture()
        if not guard.persistent_grads and any(p.grad is not None for p in guard.params):
            raise RuntimeError("a guarded window must start with clear gradients "
                               "(optimizer.zero_grad(set_to_none=True) first)")

    def run(self, step_fn: Callable[[], T], *, shape: Hashable | None = None) -> T:
        """Run ``step_fn`` guarded. ``shape`` is its batch's shape (any hashable key, e.g.
        (batch, height, width)): the first calls at each shape are guarded, because compiled
        code may compile or record a CUDA graph for it there. None: the caller cannot say."""
        guard = self.guard
        self.steps.append(step_fn)
        pending = [step_fn]
        while True:
            before = guard.begin_call(shape)
            try:
                outputs = [fn() for fn in pending]
            except Exception as err:
                compiled_during = guard.compiled_since(before)
                failing = guard.failing(err, compiled_during)
                if not failing:
                    raise
                if guard.strict:
                    raise guard.strict_error(failing, err) from err
                if why := guard.replay_blocker():
                    raise guard.unreplayable_error(failing, err, why) from err
                reason = describe(err)
            else:
                guard.after_success(guard.compiled_since(before), shape)
                self.results.extend(outputs)
                return outputs[-1]
            # Past the except block Python has dropped `err`: its traceback's frames held the
            # failed attempt's activations, which must be free before memory is released.
            self.results = []
            guard.clear_grads()
            self._rng.restore()
            guard.fall_back(failing, reason)
            pending = list(self.steps)


@dataclass
class _RandomState:
    """The global CPU (and CUDA) generator states: a few KB, taken at each window's start."""
    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def capture(cls) -> "_RandomState":
        return cls(torch.get_rng_state(),
                   torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
