"""The compile engine the trainer drives: apply plans, guard micro-steps, fall back, report.

Compilation is lazy: ``torch.compile`` returns at once and the real work (and most failures)
happen inside the first forward and backward. So the trainer runs each micro-step through
`CompileEngine.run_guarded`. During a component's probation (its first few successful calls)
a failure restores the gradients and RNG state from before the call, moves the failing
component one backend down the chain (TRITON -> INDUCTOR -> DEFAULT -> AOT_EAGER -> NONE), and
runs the same call again. No step is lost and none is counted twice, because the trainer calls
``optimizer.step()`` only after the guarded call returned.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from modules.compile.backends import BACKENDS, BackendRow, check_table
from modules.compile.cache import use_compile_cache
from modules.compile.capabilities import Capabilities, detect_capabilities
from modules.compile.plan import (COMPONENT_LABELS, COMPONENTS, CompileError, CompilePlan,
                                  build_plan, next_backend)
from modules.compile.regions import REPEATED_BLOCKS, compile_targets
from modules.compile.tracking import CompileTracker, ComponentStats, TrackedCall
from modules.config.schema import CompileBackend, CompileConfig, CompileScope
from modules.events import CompileEvent, NullCallbacks, TrainerCallbacks

T = TypeVar("T")
INDUCTOR_FAMILY = {CompileBackend.DEFAULT, CompileBackend.INDUCTOR, CompileBackend.TRITON}


def first_line(err: BaseException) -> str:
    """The first informative line of an error ("backend='x' raised:" is followed by the cause)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


@dataclass
class _Component:
    name: str
    modules: list[nn.Module]
    plan: CompilePlan
    targets: list[nn.Module] = field(default_factory=list)
    scope: CompileScope = CompileScope.FULL
    fallbacks: list[dict[str, str]] = field(default_factory=list)
    degraded: list[str] = field(default_factory=list)
    successes: int = 0
    announced: bool = False

    @property
    def label(self) -> str:
        return COMPONENT_LABELS[self.name]


class _Snapshot:
    """Gradients and RNG state before a guarded call, to undo a failed attempt exactly."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = params
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        for param, grad in zip(self.params, self.grads):
            param.grad = None if grad is None else grad.clone()
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


class CompileEngine:
    """Compiles the selected components in place and guards the first steps against failures.

    ``components`` maps "unet" / "text_encoder" / "vae" to a module or a list of modules (every
    text encoder of the model). ``trainable_params`` are the tensors whose ``.grad`` a failed
    attempt must not leave changed (default: every parameter with ``requires_grad``).
    ``capabilities``, ``table`` and ``regional_blocks`` exist for tests (a forced machine; rows
    with failing backends; fewer block classes so a real inductor test stays affordable).
    """

    def __init__(self, config: CompileConfig,
                 components: Mapping[str, nn.Module | Sequence[nn.Module] | None], *,
                 callbacks: TrainerCallbacks | None = None,
                 device: torch.device | str = "cpu",
                 capabilities: Capabilities | None = None,
                 trainable_params: Iterable[torch.Tensor] | None = None,
                 cache_dir: str | Path | None = None,
                 probation_steps: int = 3,
                 recompile_warning_after: int = 2,
                 table: Mapping[CompileBackend, BackendRow | None] = BACKENDS,
                 regional_blocks: Mapping[str, tuple[str, ...]] = REPEATED_BLOCKS):
        unknown = set(components) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown compile components {sorted(unknown)}; expected {COMPONENTS}")
        check_table(table)
        self.config = config
        self.callbacks = callbacks or NullCallbacks()
        self.caps = capabilities or detect_capabilities(device)
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
            self.components[name] = _Component(name, modules,
                                               build_plan(config, name, self.caps, table))
        if trainable_params is None:
            trainable_params = [p for c in self.components.values() for m in c.modules
                                for p in m.parameters() if p.requires_grad]
        self.params = list(trainable_params)
        self._late_recompiles: dict[str, int] = {}
        self._restore_cache: Callable[[], None] | None = None
        self._applied = False

    # -- applying -----------------------------------------------------------------------------
    def apply(self) -> dict[str, CompilePlan]:
        """Compile every selected component in place; report degradations first."""
        if self._applied:
            raise RuntimeError("CompileEngine.apply() was already called")
        self._applied = True
        if any(c.plan.compiled for c in self.components.values()):
            self._restore_cache = use_compile_cache(self.cache_dir)
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

    def _apply_component(self, comp: _Component) -> None:
        if not comp.plan.compiled:
            return
        if not comp.modules:
            self._degrade(comp, f"{comp.label} is not part of this run; not compiled")
            comp.plan = build_plan(self.config, comp.name, self.caps, self.table,
                                   backend=CompileBackend.NONE)
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
        comp.successes = 0
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
        """Undo every compilation and the engine's hooks (cache folder, dynamo callbacks)."""
        for comp in self.components.values():
            self._undo_component(comp)
        self.tracker.uninstall()
        if self._restore_cache is not None:
            self._restore_cache()
            self._restore_cache = None

    # -- guarded calls --------------------------------------------------------------------------
    def _in_probation(self) -> list[_Component]:
        return [c for c in self.components.values()
                if c.plan.compiled and c.successes < self.probation_steps]

    def run_guarded(self, step_fn: Callable[[], T]) -> T:
        """Run ``step_fn`` (forward + loss + backward, no optimizer step) with compile fallback.

        ``step_fn`` must be repeatable: draw noise and timesteps outside it. After every
        component's probation, errors propagate unchanged.
        """
        if not self._in_probation():
            return step_fn()
        snapshot = _Snapshot(self.params)
        while True:
            self.tracker.last_failure = None
            try:
                result = step_fn()
            except Exception as err:
                failing = self._attribute()
                if not failing:
                    raise
                if self.config.strict:
                    raise CompileError(self._strict_message(failing, err)) from err
                snapshot.restore()
                self._fall_back(failing, err)
                continue
            self._after_success()
            return result

    run = run_guarded  # the trainer's guard protocol: guard.run(step_fn), guard.report()

    def _attribute(self) -> list[_Component]:
        """The component(s) to blame: the compiled module the error came out of, else all."""
        suspects = self._in_probation()
        named = [c for c in suspects if c.name == self.tracker.last_failure]
        return named or suspects

    def _strict_message(self, failing: list[_Component], err: Exception) -> str:
        names = ", ".join(f"{c.label} ({c.plan.effective.value})" for c in failing)
        return (f"compiling {names} failed and compile.strict is on: "
                f"{type(err).__name__}: {first_line(err)}")

    def _fall_back(self, failing: list[_Component], err: Exception) -> None:
        import torch._dynamo

        reason = f"{type(err).__name__}: {first_line(err)}"
        for comp in self.components.values():
            self._undo_component(comp)
        for comp in failing:
            old = comp.plan.effective
            new = next_backend(old, self.caps)
            comp.plan = build_plan(self.config, comp.name, self.caps, self.table, backend=new)
            comp.fallbacks.append({"from": old.value, "to": new.value, "reason": reason})
            stats = self.tracker.component(comp.name)
            stats.graphs = stats.calls_after_graph = 0  # "ran" is about the backend now in use
            self._emit(comp, f"{comp.label}: {old.value} failed ({reason}); "
                             f"falling back to {new.value}", kind="fallback")
        # Drop every compiled frame and guard so the retry compiles from scratch.
        torch._dynamo.reset()
        self.tracker.after_dynamo_reset()
        for comp in self.components.values():
            self._apply_component(comp)

    def _after_success(self) -> None:
        for comp in self.components.values():
            if not comp.plan.compiled:
                continue
            comp.successes += 1
            stats = self.tracker.component(comp.name)
            if comp.announced:
                continue
            if stats.calls == 0:
                if comp.name == "unet":  # every training step calls the UNet
                    comp.announced = True
                    self._emit(comp, "UNet is compiled but its compiled code was never called: "
                                     "the step bypasses the compiled modules", kind="warning")
                continue
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
              kind: str = "progress") -> None:
        self.callbacks.on_compile(CompileEvent(comp.name, message, seconds, kind))

    def _degrade(self, comp: _Component, reason: str) -> None:
        comp.degraded.append(reason)
        self._emit(comp, f"{comp.label}: {reason}", kind="degraded")

    def _on_graph(self, name: str, stats: ComponentStats, seconds: float) -> None:
        comp = self.components[name]
        if not comp.announced:
            self._emit(comp, f"compiling {comp.label}: graph {stats.compiles} "
                             f"({stats.compile_seconds:.1f} s so far)", seconds=seconds)

    def _on_recompile(self, name: str, stats: ComponentStats, reasons: list[str]) -> None:
        comp = self.components[name]
        if comp.successes < self.probation_steps:
            return  # warm-up: new block shapes and the first dynamic sizes are expected
        late = self._late_recompiles[name] = self._late_recompiles.get(name, 0) + 1
        why = reasons[-1].splitlines()[0] if reasons else "unknown reason"
        self._emit(comp, f"{comp.label} recompiled: {why}", kind="recompile")
        if late == self.recompile_warning_after:
            self._emit(comp, f"{comp.label} keeps recompiling after warm-up ({late} times); "
                             "varying shapes or Python values in the step are the usual cause "
                             f"(last: {why})", kind="warning")

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
        cache_on = bool(self.cache_dir) and plan.effective in INDUCTOR_FAMILY
        return {
            "requested": plan.requested.value,
            "effective": plan.effective.value,
            "scope": comp.scope.value if plan.compiled else self.config.scope.value,
            "torch_compile_kwargs": dict(plan.torch_compile_kwargs),
            "inductor_options": dict(plan.inductor_options),
            "fallbacks": list(comp.fallbacks),
            "degraded": "; ".join(comp.degraded) or None,
            "compile_seconds": round(stats.compile_seconds, 3),
            "recompiles": stats.recompiles,
            "recompile_reasons": list(stats.recompile_reasons),
            "cache": ("off" if not cache_on else
                      "hit" if stats.cache_hits and not stats.cache_misses else "miss"),
            "compiled_code_ran": plan.compiled and stats.compiled_code_ran,
        }
