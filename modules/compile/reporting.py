"""What the compile engine says: compile events for the front ends, and the run record's section.

`CompileReporter` turns what happens to each component (compiling, graphs, recompiles, a
degrade, a fallback, the first call of its compiled code) into `CompileEvent`s on the trainer's
callbacks, and writes ``report()``: per component, the plan that ran and what happened, with
stable keys (run.json ``compile``; docs/compilation.md "What the run tells you").
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from modules.compile.backends import BackendRow
from modules.compile.bundle import BundleKeeper
from modules.compile.guards import late_recompile_sentence, summarize_guard_failure
from modules.compile.plan import COMPONENT_LABELS, CompilePlan
from modules.compile.tracking import CompileTracker, ComponentStats
from modules.config.schema import CompileBackend, CompileConfig, CompileScope
from modules.events import CompileEvent, TrainerCallbacks

MAX_KEPT_REASONS = 20


@dataclass
class CompiledComponent:
    """One compile component of the run: its modules, the plan in force, and what happened.

    Shared by the engine's parts: the applier sets ``plan``, ``targets`` and ``scope``; the
    guard counts ``quiet_calls``; the reporter records ``degraded``, ``fallbacks`` and
    ``announced``.
    """
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


class CompileReporter:
    """Compile events to ``callbacks`` and the per-component report.

    ``recompile_expected`` says whether a recompile now is part of warm-up or of a new input
    shape (the guard knows); any other one is reported as late.
    """

    def __init__(self, config: CompileConfig, components: Mapping[str, CompiledComponent],
                 tracker: CompileTracker, callbacks: TrainerCallbacks,
                 table: Mapping[CompileBackend, BackendRow], cache_dir: str | Path | None,
                 recompile_expected: Callable[[], bool], recompile_warning_after: int = 2,
                 bundles: BundleKeeper | None = None):
        self.config = config
        self.components = components
        self.tracker = tracker
        self.callbacks = callbacks
        self.table = table
        self.cache_dir = cache_dir
        self.recompile_expected = recompile_expected
        self.recompile_warning_after = recompile_warning_after
        self.late_recompiles: dict[str, int] = {}
        self.bundles = bundles  # None: bundles off (the applier clears it where none apply)

    # -- events ---------------------------------------------------------------------------------
    def emit(self, comp: CompiledComponent, message: str, seconds: float = 0.0,
             kind: str = "progress", detail: str = "", graph: int = 0) -> None:
        self.callbacks.on_compile(CompileEvent(comp.name, message, seconds, kind, detail, graph))

    def bundle_event(self, message: str, kind: str) -> None:
        """A compile bundle's news, on the first compiled component (the denoiser's when it
        is compiled): bundles are per run, the events per component."""
        comp = next((c for c in self.components.values() if c.plan.compiled), None)
        if comp is not None:
            self.emit(comp, message, kind=kind)

    def bundle_status(self, comp: CompiledComponent, cache_on: bool) -> str:
        """run.json's per-component ``bundle``: off, hit, miss, or mismatch / damaged with why.
        A hit whose component still compiled graphs cold says how many."""
        if self.bundles is None or not cache_on or not comp.plan.compiled:
            return "off"
        lookup = self.bundles.lookup
        misses = self.tracker.component(comp.name).cache_misses
        if lookup.status == "hit" and misses:
            return f"hit ({misses} graphs not in it were compiled)"
        return lookup.describe()

    def degrade(self, comp: CompiledComponent, reason: str) -> None:
        comp.degraded.append(reason)
        self.emit(comp, f"{comp.label}: {reason}", kind="degraded")

    def compiling(self, comp: CompiledComponent) -> None:
        where = (f"regional, {len(comp.targets)} blocks" if comp.scope == CompileScope.REGIONAL
                 else "full")
        self.emit(comp, f"compiling {comp.label} ({comp.plan.effective.value}, {where})… "
                        "the first step waits for it")

    def fell_back(self, comp: CompiledComponent, old: CompileBackend, reason: str) -> None:
        new = comp.plan.effective
        comp.fallbacks.append({"from": old.value, "to": new.value, "reason": reason})
        self.emit(comp, f"{comp.label}: {old.value} failed ({reason}); "
                        f"falling back to {new.value}", kind="fallback")

    def after_call(self, comp: CompiledComponent, compiled: bool) -> None:
        """After a successful guarded call: progress of a component still compiling, and the
        one message that says whether its compiled code ran."""
        stats = self.tracker.component(comp.name)
        if compiled and comp.announced:
            self.emit(comp, f"{comp.label}: compiled {stats.graphs} graphs so far "
                            f"({stats.compile_seconds:.1f} s in all)",
                      seconds=stats.compile_seconds)
        if not comp.announced:
            self._announce(comp, stats)

    def _announce(self, comp: CompiledComponent, stats: ComponentStats) -> None:
        if stats.calls == 0:
            if comp.name == "unet":  # every training step calls the UNet
                comp.announced = True
                self.emit(comp, "UNet is compiled but its compiled code was never called: "
                                "the step bypasses the compiled modules", kind="warning")
            return
        comp.announced = True
        if stats.graphs == 0:
            self.emit(comp, f"{comp.label} was called but dynamo produced no graph: its "
                            "compiled code did not run", kind="warning")
        else:
            self.emit(comp, f"{comp.label} compiled in {stats.compile_seconds:.1f} s "
                            f"({stats.graphs} graphs)", seconds=stats.compile_seconds,
                      kind="done")

    # -- the tracker's callbacks ----------------------------------------------------------------
    def graph_compiled(self, name: str, stats: ComponentStats, seconds: float) -> None:
        comp = self.components[name]
        if not comp.announced:
            self.emit(comp, f"compiling {comp.label}: graph {stats.compiles} "
                            f"({stats.compile_seconds:.1f} s so far)", seconds=seconds,
                      graph=stats.compiles)

    def recompiled(self, name: str, stats: ComponentStats, reasons: list[str]) -> None:
        """A recompile during warm-up or for a new input shape is expected; any other one
        throws compiled code away mid-training and is reported, in one short sentence."""
        if self.recompile_expected():
            return
        comp = self.components[name]
        late = self.late_recompiles[name] = self.late_recompiles.get(name, 0) + 1
        stats.late_recompiles = late
        why = summarize_guard_failure(reasons[-1] if reasons else "")
        detail = "\n".join(reasons[-3:])
        self.emit(comp, late_recompile_sentence(comp.label, why, late), kind="recompile",
                  detail=detail)
        if late == self.recompile_warning_after:
            self.emit(comp, f"{comp.label} keeps recompiling after warm-up ({late} times) "
                            f"because {why}.", kind="warning", detail=detail)

    def recompile_limit_hit(self, name: str, stats: ComponentStats) -> None:
        comp = self.components[name]
        if stats.recompile_limit_hits == 1 or stats.recompile_limit_hits % 100 == 0:
            self.emit(comp, f"{comp.label} hit torch._dynamo's recompile limit "
                            f"({stats.recompile_limit_hits} times): the code past it runs "
                            "uncompiled; too many distinct shapes?", kind="warning")

    # -- the run record -------------------------------------------------------------------------
    def report(self) -> dict[str, dict[str, Any]]:
        """Per component, the run record's compile section (keys are stable)."""
        return {name: self.component_report(comp) for name, comp in self.components.items()}

    def component_report(self, comp: CompiledComponent) -> dict[str, Any]:
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
            "cache_hits": stats.cache_hits,      # graphs inductor's cache (or a bundle) served
            "cache_misses": stats.cache_misses,  # graphs compiled cold
            "bundle": self.bundle_status(comp, cache_on),
            "compiled_code_ran": plan.compiled and stats.compiled_code_ran,
        }
