"""The compile engine the trainer drives: apply plans, guard micro-steps, fall back, report.

Compilation is lazy: ``torch.compile`` returns at once and the real work (and most failures)
happen inside a forward or backward, at the first step and again whenever a new shape, a new
bucket or a short last batch makes dynamo compile. So the trainer runs every micro-step of an
optimizer step through a `GuardedWindow`. A call is guarded when a compile happened during it,
when a compiled component is still in its first calls after a compile (CUDA graphs warm up
and record there), or when its batch shape is in its first calls since the compiled code was
built: CUDA graph trees record one graph per shape, on the second call at that shape, without
any dynamo compile (dynamic sizes). A failure in a guarded call moves the failing component one backend down the
chain (TRITON -> INDUCTOR -> DEFAULT -> AOT_EAGER -> NONE), resets the gradients to their state
at the window's start (clear: the optimizer has just zeroed them) and the random state, and
replays every micro-step of the window with the same batches and pre-drawn noise. Nothing is
copied, no step is lost and none is counted twice, because the trainer calls
``optimizer.step()`` only after the window's last micro-step returned.

An out-of-memory error is not a compile failure: it propagates unchanged unless it was raised
while compiling (autotuning, for example), or while a CUDA-graphed component may be recording
(its graph pools hold memory of their own, which the next backend down does not need). Before
the retry, the failed attempt's cached GPU memory is released (`release_device_memory`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from modules.compile.backends import BACKENDS, BackendRow, check_table
from modules.compile.cache import use_compile_cache
from modules.compile.capabilities import Capabilities, detect_capabilities
from modules.compile.dynamic_dims import input_dims, mark_input
from modules.compile.guards import late_recompile_sentence, summarize_guard_failure
from modules.compile.plan import (COMPONENT_LABELS, COMPONENTS, CompileError, CompileFacts,
                                  CompilePlan, ComponentTraining, next_backend, plan_component)
from modules.compile.regions import REPEATED_BLOCKS, compile_targets
from modules.compile.tracking import CompileTracker, ComponentStats, TrackedCall
from modules.config.schema import CompileBackend, CompileConfig, CompileScope
from modules.events import CompileEvent, NullCallbacks, TrainerCallbacks
from modules.util.errors import describe, first_line, is_out_of_memory
from modules.util.memory import release_device_memory

T = TypeVar("T")
MAX_KEPT_REASONS = 20


@dataclass
class _Component:
    name: str
    modules: list[nn.Module]
    plan: CompilePlan
    targets: list[nn.Module] = field(default_factory=list)
    scope: CompileScope = CompileScope.FULL
    fallbacks: list[dict[str, str]] = field(default_factory=list)
    degraded: list[str] = field(default_factory=list)
    quiet_calls: int = 0        # successful calls since this component last compiled
    announced: bool = False

    @property
    def label(self) -> str:
        return COMPONENT_LABELS[self.name]


class CompileEngine:
    """Compiles the selected components in place and guards training steps against failures.

    ``components`` maps "unet" / "text_encoder" / "vae" to a module or a list of modules (every
    text encoder of the model). ``trainable_params`` are the tensors whose ``.grad`` a failed
    attempt resets (default: every parameter with ``requires_grad``). ``training`` says how each
    component is trained (checkpointing, accumulation), which decides CUDA graphs.
    ``capabilities``, ``table`` and ``regional_blocks`` exist for tests (a forced machine; rows
    with failing backends; fewer block classes so a real inductor test stays affordable).
    """

    def __init__(self, config: CompileConfig,
                 components: Mapping[str, nn.Module | Sequence[nn.Module] | None], *,
                 callbacks: TrainerCallbacks | None = None,
                 device: torch.device | str = "cpu",
                 capabilities: Capabilities | None = None,
                 trainable_params: Iterable[torch.Tensor] | None = None,
                 training: Mapping[str, ComponentTraining] | None = None,
                 cache_dir: str | Path | None = None,
                 probation_steps: int = 3,
                 recompile_warning_after: int = 2,
                 table: Mapping[CompileBackend, BackendRow] = BACKENDS,
                 regional_blocks: Mapping[str, tuple[str, ...]] = REPEATED_BLOCKS):
        unknown = set(components) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown compile components {sorted(unknown)}; expected {COMPONENTS}")
        check_table(table)
        self.config = config
        self.callbacks = callbacks or NullCallbacks()
        self.caps = capabilities or detect_capabilities(device)
        self.facts = CompileFacts(self.caps, dict(training or {}))
        self.table = table
        self.regional_blocks = regional_blocks
        self.cache_dir = config.cache_dir if cache_dir is None else cache_dir
        self.probation_steps = probation_steps
        self.recompile_warning_after = recompile_warning_after
        self.tracker = CompileTracker(on_graph=self._on_graph, on_recompile=self._on_recompile,
                                      on_limit=self._on_recompile_limit)
        self.components: dict[str, _Component] = {}
        for name in COMPONENTS:
            found = components.get(name)
            modules = [] if found is None else (
                [found] if isinstance(found, nn.Module) else list(found))
            self.components[name] = _Component(name, modules, self._plan(name))
        if trainable_params is None:
            trainable_params = [p for c in self.components.values() for m in c.modules
                                for p in m.parameters() if p.requires_grad]
        self.params = list(trainable_params)
        self.calls = 0                      # successful guarded calls, all windows together
        self._new_shape = False             # the call in flight trains a shape not seen before
        self._shape_warming = False         # ... or one still in its first calls (see _begin_call)
        # successful calls per batch shape since the compiled code was last built (a fallback
        # rebuilds it: every shape compiles and records again)
        self._shape_calls: dict[Hashable, int] = {}
        self._late_recompiles: dict[str, int] = {}
        self._restore: list[Callable[[], None]] = []
        self._applied = False

    def _plan(self, name: str, backend: CompileBackend | None = None) -> CompilePlan:
        return plan_component(self.config, name, self.facts, self.table, backend)

    # -- applying -----------------------------------------------------------------------------
    def apply(self) -> dict[str, CompilePlan]:
        """Compile every selected component in place; report degradations first."""
        if self._applied:
            raise RuntimeError("CompileEngine.apply() was already called")
        self._applied = True
        if any(c.plan.compiled for c in self.components.values()):
            import torch._dynamo

            # A clean compiler state per run: compiled frames left by an earlier run in this
            # process (the GUI trains several) would be reused without a compile, and this
            # run's report would then say its compiled code never ran.
            torch._dynamo.reset()
            self._restore.append(use_compile_cache(self.cache_dir))
            self._raise_process_recompile_limit()
            self.tracker.install()
        for comp in self.components.values():
            if comp.plan.degraded:
                self._degrade(comp, comp.plan.degraded)
            for note in comp.plan.notes:
                self._emit(comp, note, kind="warning")
            self._apply_component(comp)
        return self.plans()

    def plans(self) -> dict[str, CompilePlan]:
        return {name: comp.plan for name, comp in self.components.items()}

    @property
    def persistent_grads(self) -> bool:
        """Whether the trainer must keep gradients allocated and zero them in place."""
        return any(c.plan.persistent_grads for c in self.components.values())

    @property
    def cudagraphs(self) -> bool:
        return any(c.plan.cudagraphs for c in self.components.values())

    def mark_varying_input(self, component: str, tensor: torch.Tensor) -> torch.Tensor:
        """Mark the input of ``component`` whose batch shapes vary (aspect-ratio buckets), as its
        current plan allows (see dynamic_dims); returns the same tensor."""
        plan = self.components[component].plan
        return mark_input(tensor, *input_dims(plan, self.config.dynamic))

    def _raise_process_recompile_limit(self) -> None:
        """Where torch.compile has no per-call ``recompile_limit`` (torch < 2.12), raise dynamo's
        process-wide one for as long as this engine is applied (restored by `close`)."""
        import torch._dynamo

        wanted = max((c.plan.process_recompile_limit or 0) for c in self.components.values())
        previous = torch._dynamo.config.recompile_limit
        if wanted > previous:
            torch._dynamo.config.recompile_limit = wanted
            self._restore.append(
                lambda: setattr(torch._dynamo.config, "recompile_limit", previous))

    def _apply_component(self, comp: _Component) -> None:
        if not comp.plan.compiled:
            return
        if not comp.modules:
            self._degrade(comp, f"{comp.label} is not part of this run; not compiled")
            comp.plan = self._plan(comp.name, CompileBackend.NONE)
            return
        targets, note = compile_targets(comp.name, comp.modules, self.config.scope,
                                        self.regional_blocks)
        comp.scope = CompileScope.FULL if note else self.config.scope
        if note and note not in comp.degraded:
            self._degrade(comp, note)
        for module in targets:
            # nn.Module.compile sets module._compiled_call_impl = torch.compile(module._call_impl,
            # ...): the module object, its parameters and state-dict keys stay as they are.
            module.compile(**comp.plan.torch_compile_kwargs)
            module._compiled_call_impl = TrackedCall(module._compiled_call_impl, self.tracker,
                                                     comp.name)
        comp.targets = targets
        comp.quiet_calls = 0
        comp.announced = False
        where = (f"regional, {len(targets)} blocks" if comp.scope == CompileScope.REGIONAL
                 else "full")
        self._emit(comp, f"compiling {comp.label} ({comp.plan.effective.value}, {where})… "
                         "the first step waits for it")

    def _undo_component(self, comp: _Component) -> None:
        for module in comp.targets:
            module._compiled_call_impl = None  # what nn.Module.compile set; None = eager again
        comp.targets = []

    def close(self) -> None:
        """Undo every compilation and the engine's process-wide settings (cache folders,
        recompile limit, dynamo callbacks)."""
        for comp in self.components.values():
            self._undo_component(comp)
        self.tracker.uninstall()
        while self._restore:
            self._restore.pop()()

    # -- guarded calls --------------------------------------------------------------------------
    def window(self) -> "GuardedWindow":
        """A new accumulation window; open it when the gradients are clear (after zero_grad)."""
        return GuardedWindow(self)

    def run_guarded(self, step_fn: Callable[[], T]) -> T:
        """``step_fn`` as a window of one micro-step (see `GuardedWindow.run`)."""
        return self.window().run(step_fn)

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Run the block with every compiled module eager (``set_stance("force_eager")``).

        For sampling: it runs the models in eval mode, without gradients and at another batch
        size, so the compiled training code would recompile (minutes per graph with autotuning
        on a GPU, a CUDA graph tree of its own with TRITON) for work that is not the hot path.
        """
        import torch.compiler

        paused = self.tracker.paused
        self.tracker.paused = True
        try:
            with torch.compiler.set_stance("force_eager"):
                yield
        finally:
            self.tracker.paused = paused

    def _suspects(self, compiled_during: set[str]) -> list[_Component]:
        """The compiled components a failure in this call may come from: those that compiled
        during it, are in their first calls after a compile, or see a batch shape still in its
        first calls (where CUDA graphs warm up and record, with no compile to tell)."""
        return [c for c in self.components.values() if c.plan.compiled
                and (c.name in compiled_during or c.quiet_calls < self.probation_steps
                     or self._shape_warming)]

    def _failing(self, err: Exception, compiled_during: set[str]) -> list[_Component]:
        """The component(s) to fall back for ``err``; empty when it is not a compile failure."""
        suspects = self._suspects(compiled_during)
        if is_out_of_memory(err) and not self.tracker.raised_while_compiling(err):
            # Only a CUDA graph's recording may have caused it: the next backend down has no
            # graph pools. Any other out-of-memory would happen on every backend.
            return [c for c in suspects if c.plan.cudagraphs]
        named = [c for c in suspects if c.name == self.tracker.last_failure]
        return named or suspects

    def _strict_message(self, failing: list[_Component], err: Exception) -> str:
        names = ", ".join(f"{c.label} ({c.plan.effective.value})" for c in failing)
        return (f"compiling {names} failed and compile.strict is on: "
                f"{type(err).__name__}: {first_line(err)}")

    def _fall_back(self, failing: list[_Component], reason: str) -> None:
        """Move ``failing`` one backend down; ``reason`` is the failure as one line (the caller
        holds no reference to the exception any more, so its tensors can be freed here)."""
        import torch._dynamo

        for comp in self.components.values():
            self._undo_component(comp)
        for comp in failing:
            old = comp.plan.effective
            new = next_backend(old, self.caps)
            comp.plan = self._plan(comp.name, new)
            comp.fallbacks.append({"from": old.value, "to": new.value, "reason": reason})
            stats = self.tracker.component(comp.name)
            stats.graphs = stats.calls_after_graph = 0  # "ran" is about the backend now in use
            self._emit(comp, f"{comp.label}: {old.value} failed ({reason}); "
                             f"falling back to {new.value}", kind="fallback")
        # Drop every compiled frame and guard so the retry compiles from scratch.
        torch._dynamo.reset()  # frees the compiled code and its CUDA graph pools too
        self.tracker.after_dynamo_reset()
        self._shape_calls.clear()  # every shape compiles (and records) again on the new backend
        release_device_memory()
        for comp in self.components.values():
            self._apply_component(comp)

    def _begin_call(self, shape: Hashable | None) -> dict[str, int]:
        self.tracker.last_failure = None
        seen = -1 if shape is None else self._shape_calls.get(shape, 0)
        self._new_shape = seen == 0
        # Cudagraph trees warm a new shape up on its first call and record it on the second;
        # the first replay after that is the first call that neither compiles nor records.
        self._shape_warming = 0 <= seen < self.probation_steps
        if self.cudagraphs:
            # Each micro-step is a new CUDA-graph generation: outputs of the previous one may
            # be overwritten from here on (the trainer keeps none of them).
            torch.compiler.cudagraph_mark_step_begin()
        return self.tracker.compile_counts()

    def _compiled_since(self, before: dict[str, int]) -> set[str]:
        after = self.tracker.compile_counts()
        return {name for name, count in after.items() if count != before.get(name, 0)}

    def _after_success(self, compiled_during: set[str], shape: Hashable | None) -> None:
        self.calls += 1
        self._new_shape = self._shape_warming = False
        if shape is not None:
            self._shape_calls[shape] = self._shape_calls.get(shape, 0) + 1
        for comp in self.components.values():
            if not comp.plan.compiled:
                continue
            stats = self.tracker.component(comp.name)
            if comp.name in compiled_during:
                comp.quiet_calls = 0
                if comp.announced:
                    self._emit(comp, f"{comp.label}: compiled {stats.graphs} graphs so far "
                                     f"({stats.compile_seconds:.1f} s in all)",
                               seconds=stats.compile_seconds)
            else:
                comp.quiet_calls += 1
            if not comp.announced:
                self._announce(comp, stats)

    def _announce(self, comp: _Component, stats: ComponentStats) -> None:
        if stats.calls == 0:
            if comp.name == "unet":  # every training step calls the UNet
                comp.announced = True
                self._emit(comp, "UNet is compiled but its compiled code was never called: "
                                 "the step bypasses the compiled modules", kind="warning")
            return
        comp.announced = True
        if stats.graphs == 0:
            self._emit(comp, f"{comp.label} was called but dynamo produced no graph: its "
                             "compiled code did not run", kind="warning")
        else:
            self._emit(comp, f"{comp.label} compiled in {stats.compile_seconds:.1f} s "
                             f"({stats.graphs} graphs)", seconds=stats.compile_seconds,
                       kind="done")

    # -- events -------------------------------------------------------------------------------
    def _emit(self, comp: _Component, message: str, seconds: float = 0.0,
              kind: str = "progress", detail: str = "", graph: int = 0) -> None:
        self.callbacks.on_compile(CompileEvent(comp.name, message, seconds, kind, detail, graph))

    def _degrade(self, comp: _Component, reason: str) -> None:
        comp.degraded.append(reason)
        self._emit(comp, f"{comp.label}: {reason}", kind="degraded")

    def _on_graph(self, name: str, stats: ComponentStats, seconds: float) -> None:
        comp = self.components[name]
        if not comp.announced:
            self._emit(comp, f"compiling {comp.label}: graph {stats.compiles} "
                             f"({stats.compile_seconds:.1f} s so far)", seconds=seconds,
                       graph=stats.compiles)

    def _on_recompile(self, name: str, stats: ComponentStats, reasons: list[str]) -> None:
        """A recompile during warm-up or for a new input shape is expected; any other one
        throws compiled code away mid-training and is reported, in one short sentence."""
        if self.calls < self.probation_steps or self._new_shape:
            return
        comp = self.components[name]
        late = self._late_recompiles[name] = self._late_recompiles.get(name, 0) + 1
        stats.late_recompiles = late
        why = summarize_guard_failure(reasons[-1] if reasons else "")
        detail = "\n".join(reasons[-3:])
        self._emit(comp, late_recompile_sentence(comp.label, why, late), kind="recompile",
                   detail=detail)
        if late == self.recompile_warning_after:
            self._emit(comp, f"{comp.label} keeps recompiling after warm-up ({late} times) "
                             f"because {why}.", kind="warning", detail=detail)

    def _on_recompile_limit(self, name: str, stats: ComponentStats) -> None:
        comp = self.components[name]
        if stats.recompile_limit_hits == 1 or stats.recompile_limit_hits % 100 == 0:
            self._emit(comp, f"{comp.label} hit torch._dynamo's recompile limit "
                             f"({stats.recompile_limit_hits} times): the code past it runs "
                             "uncompiled; too many distinct shapes?", kind="warning")

    # -- report ---------------------------------------------------------------------------------
    def report(self) -> dict[str, dict[str, Any]]:
        """Per component, the run record's compile section (keys are stable)."""
        return {name: self._component_report(comp) for name, comp in self.components.items()}

    def _component_report(self, comp: _Component) -> dict[str, Any]:
        stats = self.tracker.component(comp.name)
        plan = comp.plan
        cache_on = bool(self.cache_dir) and self.table[plan.effective].inductor
        limit = plan.torch_compile_kwargs.get("recompile_limit") or plan.process_recompile_limit
        return {
            "requested": plan.requested.value,
            "effective": plan.effective.value,
            "scope": comp.scope.value if plan.compiled else self.config.scope.value,
            "torch_compile_kwargs": dict(plan.torch_compile_kwargs),
            "inductor_options": dict(plan.inductor_options),
            "cudagraphs": plan.cudagraphs,
            "persistent_grads": plan.persistent_grads,
            "recompile_limit": None if not limit else {
                "value": limit,
                "where": "process" if plan.process_recompile_limit else "torch.compile"},
            "notes": list(plan.notes),
            "fallbacks": list(comp.fallbacks),
            "degraded": "; ".join(comp.degraded) or None,
            "compile_seconds": round(stats.compile_seconds, 3),
            "compiles": stats.compiles,  # graphs compiled (dynamo's and lazy backward ones)
            "recompiles": stats.recompiles,
            "late_recompiles": stats.late_recompiles,
            "recompile_reasons": list(stats.recompile_reasons[-MAX_KEPT_REASONS:]),
            "cache": ("off" if not cache_on else
                      "hit" if stats.cache_hits and not stats.cache_misses else "miss"),
            "compiled_code_ran": plan.compiled and stats.compiled_code_ran,
        }


class GuardedWindow:
    """The micro-steps of one optimizer step, run so that a compile failure can be undone.

    ``run(step_fn)`` runs one micro-step (forward + loss + backward, no optimizer step); its
    results are kept in ``results`` in order. ``step_fn`` must be repeatable: draw noise and
    timesteps outside it. On a compile failure every micro-step of the window so far is run
    again on the fallback backend, from clear gradients and the random state of the window's
    start, and ``results`` is rebuilt from that replay.
    """

    def __init__(self, engine: CompileEngine):
        self.engine = engine
        self.steps: list[Callable[[], Any]] = []
        self.results: list[Any] = []
        self._rng = _RandomState.capture()
        if not engine.persistent_grads and any(p.grad is not None for p in engine.params):
            raise RuntimeError("a guarded window must start with clear gradients "
                               "(optimizer.zero_grad(set_to_none=True) first)")

    def run(self, step_fn: Callable[[], T], *, shape: Hashable | None = None) -> T:
        """Run ``step_fn`` guarded. ``shape`` is its batch's shape (any hashable key, e.g.
        (batch, height, width)): the first calls at each shape are guarded, because compiled
        code may compile or record a CUDA graph for it there. None: the caller cannot say."""
        engine = self.engine
        self.steps.append(step_fn)
        pending = [step_fn]
        while True:
            before = engine._begin_call(shape)
            try:
                outputs = [fn() for fn in pending]
            except Exception as err:
                compiled_during = engine._compiled_since(before)
                failing = engine._failing(err, compiled_during)
                if not failing:
                    raise
                if engine.config.strict:
                    raise CompileError(engine._strict_message(failing, err)) from err
                reason = describe(err)
            else:
                engine._after_success(engine._compiled_since(before), shape)
                self.results.extend(outputs)
                return outputs[-1]
            # Past the except block Python has dropped `err`: its traceback's frames held the
            # failed attempt's activations, which must be free before memory is released.
            self.results = []
            self._reset()
            engine._fall_back(failing, reason)
            pending = list(self.steps)

    def _reset(self) -> None:
        """Gradients and random state back to the window's start, without copying anything."""
        for param in self.engine.params:
            if param.grad is None:
                continue
            if self.engine.persistent_grads:
                param.grad.zero_()
            else:
                param.grad = None
        self._rng.restore()


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
