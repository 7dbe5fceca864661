"""Applying compile plans: each component's modules compiled in place, undone, re-planned.

`PlanApplier` owns what applying a plan changes outside the modules too (dynamo's state, the
compile cache folders, dynamo's process-wide recompile limit where torch.compile has no per-call
one, the tracker's dynamo callbacks) and puts it back in ``close()``.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from modules.compile.backends import BackendRow
from modules.compile.bundle import BundleKeeper
from modules.compile.cache import use_compile_cache
from modules.compile.grad_inputs import SteadyGradInputs
from modules.compile.outer import OuterCall, set_compiled_call
from modules.compile.plan import CompileFacts, CompilePlan, plan_component
from modules.compile.regions import compile_targets
from modules.compile.reporting import CompiledComponent, CompileReporter
from modules.compile.tracking import CompileTracker, TrackedCall
from modules.config.schema import CompileBackend, CompileConfig, CompileScope


class PlanApplier:
    """Compiles components in place as their plans say, and undoes it."""

    def __init__(self, config: CompileConfig, components: Mapping[str, CompiledComponent],
                 facts: CompileFacts, table: Mapping[CompileBackend, BackendRow],
                 regional_blocks: Mapping[str, tuple[str, ...]], cache_dir: str | Path | None,
                 tracker: CompileTracker, reporter: CompileReporter,
                 bundles: BundleKeeper | None = None):
        self.config = config
        self.components = components
        self.facts = facts
        self.table = table
        self.regional_blocks = regional_blocks
        self.cache_dir = cache_dir
        self.tracker = tracker
        self.reporter = reporter
        self.bundles = bundles
        self._restore: list[Callable[[], None]] = []
        self._applied = False

    def plan(self, name: str, backend: CompileBackend | None = None) -> CompilePlan:
        """``name``'s plan (on ``backend`` when falling back) with the run's facts."""
        return plan_component(self.config, name, self.facts, self.table, backend)

    def apply(self) -> None:
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
            self._load_bundle()
            self._raise_process_recompile_limit()
            self.tracker.install()
        for comp in self.components.values():
            if comp.plan.degraded:
                self.reporter.degrade(comp, comp.plan.degraded)
            for note in comp.plan.notes:
                self.reporter.emit(comp, note, kind="warning")
            self.compile(comp)

    def _load_bundle(self) -> None:
        """Load the run's compile bundle into the cache folder just set, before anything
        compiles; say what was found. Off where nothing compiles with inductor."""
        uses_inductor = any(self.table[c.plan.effective].inductor
                            for c in self.components.values() if c.plan.compiled)
        if self.bundles is None or not self.cache_dir or not uses_inductor:
            self.bundles = self.reporter.bundles = None
            return
        lookup = self.bundles.load(Path(self.cache_dir).expanduser().resolve())
        for skipped in lookup.skipped:
            self.reporter.bundle_event(f"compile bundle skipped: {skipped}", "warning")
        if lookup.status == "hit":
            ahead = f", {lookup.why}" if self.bundles.from_ahead(lookup) else ""
            self.reporter.bundle_event(f"compile bundle loaded: {lookup.path} "
                                       f"({self.bundles.loaded_entries} entries{ahead})", "done")
        elif lookup.status in ("mismatch", "damaged"):
            self.reporter.bundle_event(f"compile bundle {lookup.path} not used: "
                                       f"{lookup.describe()}; compiling cold", "warning")

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

    def compile(self, comp: CompiledComponent) -> None:
        """Compile ``comp``'s modules (or its repeated blocks) in place as its plan says."""
        if not comp.plan.compiled:
            return
        if not comp.modules:
            self.reporter.degrade(comp, f"{comp.label} is not part of this run; not compiled")
            comp.plan = self.plan(comp.name, CompileBackend.NONE)
            return
        targets, note = compile_targets(comp.name, comp.modules, self.config.scope,
                                        self.regional_blocks)
        comp.scope = CompileScope.FULL if note else self.config.scope
        if note and note not in comp.degraded:
            self.reporter.degrade(comp, note)
        for module in targets:
            # nn.Module.compile sets module._compiled_call_impl = torch.compile(module._call_impl,
            # ...): the module object, its parameters and state-dict keys stay as they are. An
            # OuterCall there (block offload) stays, around the compiled call (compile/outer.py).
            outer = module._compiled_call_impl
            module.compile(**comp.plan.torch_compile_kwargs)
            compiled = module._compiled_call_impl
            assert compiled is not None  # module.compile just set it
            if isinstance(outer, OuterCall):
                module._compiled_call_impl = outer
            if comp.scope == CompileScope.REGIONAL:  # one graph per block shape (grad_inputs.py)
                compiled = SteadyGradInputs(compiled, module)
            set_compiled_call(module, TrackedCall(compiled, self.tracker, comp.name))
        comp.targets = targets
        comp.quiet_calls = 0
        comp.announced = False
        self.reporter.compiling(comp)

    def move_down(self, comp: CompiledComponent, backend: CompileBackend) -> None:
        """Give ``comp`` the plan for ``backend`` (compiled again by `compile`)."""
        comp.plan = self.plan(comp.name, backend)

    def undo(self) -> None:
        """Every component eager again (what nn.Module.compile set, cleared)."""
        for comp in self.components.values():
            for module in comp.targets:
                set_compiled_call(module, None)  # None = eager again
            comp.targets = []

    def compile_all(self) -> None:
        for comp in self.components.values():
            self.compile(comp)

    def close(self) -> None:
        """Undo every compilation and the process-wide settings (cache folders, recompile
        limit, dynamo callbacks)."""
        self.undo()
        self.tracker.uninstall()
        while self._restore:
            self._restore.pop()()
