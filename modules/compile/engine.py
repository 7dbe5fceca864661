"""The compile engine the trainer drives: apply plans, guard micro-steps, fall back, report.

`CompileEngine` puts three parts together, each in its own module and talking to the others
only through public methods:

* `PlanApplier` (applier.py) compiles each component in place as its plan says, undoes it, and
  owns the process-wide settings applying changes (cache folders, recompile limit);
* `FallbackGuard` and `GuardedWindow` (guarded.py) run each optimizer step's micro-steps so
  that a compile failure moves the failing component one backend down and replays the window;
* `CompileReporter` (reporting.py) turns what happens into compile events and writes the run
  record's compile section.

The plans themselves come from `build_plan` / `plan_component` (plan.py) with the run's facts.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from modules.compile.applier import PlanApplier
from modules.compile.bundle import BundleKeeper, compiled_cold
from modules.compile.backends import BACKENDS, BackendRow, check_table
from modules.compile.capabilities import Capabilities, detect_capabilities
from modules.compile.dynamic_dims import input_dims, mark_input
from modules.compile.guarded import FallbackGuard, GuardedWindow
from modules.compile.plan import (COMPONENTS, CompileFacts, CompilePlan, ComponentTraining,
                                  plan_component)
from modules.compile.regions import REPEATED_BLOCKS
from modules.compile.reporting import CompiledComponent, CompileReporter
from modules.compile.tracking import CompileTracker
from modules.config.schema import CompileBackend, CompileConfig, DynamicShapes
from modules.events import NullCallbacks, TrainerCallbacks

T = TypeVar("T")


class CompileEngine:
    """Compiles the selected components in place and guards training steps against failures.

    ``components`` maps "unet" / "text_encoder" / "vae" to a module or a list of modules (every
    text encoder of the model). ``trainable_params`` are the tensors whose ``.grad`` a failed
    attempt resets (default: every parameter with ``requires_grad``). ``training`` says how each
    component is trained (checkpointing, accumulation), which decides CUDA graphs; with
    ``capabilities`` it makes the `CompileFacts` the plans are built with.
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
                 regional_blocks: Mapping[str, tuple[str, ...]] = REPEATED_BLOCKS,
                 bundles: BundleKeeper | None = None):
        unknown = set(components) - set(COMPONENTS)
        if unknown:
            raise ValueError(f"unknown compile components {sorted(unknown)}; expected {COMPONENTS}")
        check_table(table)
        self.config = config
        self.caps = capabilities or detect_capabilities(device)
        self.facts = CompileFacts(self.caps, dict(training or {}))
        self.cache_dir = config.cache_dir if cache_dir is None else cache_dir
        # bundles live in the cache folder's world: without one there is nothing to carry
        self.bundles = bundles if self.cache_dir else None
        self.components: dict[str, CompiledComponent] = {}
        for name in COMPONENTS:
            found = components.get(name)
            modules = [] if found is None else (
                [found] if isinstance(found, nn.Module) else list(found))
            plan = plan_component(config, name, self.facts, table)
            self.components[name] = CompiledComponent(name, modules, plan)
        if trainable_params is None:
            trainable_params = [p for c in self.components.values() for m in c.modules
                                for p in m.parameters() if p.requires_grad]
        # The tracker calls the reporter, which asks the guard whether a recompile is expected:
        # built in that order, each given the others' public methods.
        self.tracker = CompileTracker(
            on_graph=lambda *args: self.reporter.graph_compiled(*args),
            on_recompile=lambda *args: self.reporter.recompiled(*args),
            on_limit=lambda *args: self.reporter.recompile_limit_hit(*args))
        self.reporter = CompileReporter(
            config, self.components, self.tracker, callbacks or NullCallbacks(), table,
            self.cache_dir, recompile_expected=lambda: self.guard.recompile_expected(),
            recompile_warning_after=recompile_warning_after, bundles=self.bundles)
        self.applier = PlanApplier(config, self.components, self.facts, table, regional_blocks,
                                   self.cache_dir, self.tracker, self.reporter, self.bundles)
        self.guard = FallbackGuard(self.components, self.applier, self.reporter, self.tracker,
                                   self.caps, trainable_params, config.strict, probation_steps)

    # -- applying -----------------------------------------------------------------------------
    def apply(self) -> dict[str, CompilePlan]:
        """Compile every selected component in place; report degradations first."""
        self.applier.apply()
        return self.plans()

    def plans(self) -> dict[str, CompilePlan]:
        return {name: comp.plan for name, comp in self.components.items()}

    @property
    def persistent_grads(self) -> bool:
        """Whether the trainer must keep gradients allocated and zero them in place."""
        return self.guard.persistent_grads

    @property
    def cudagraphs(self) -> bool:
        return self.guard.cudagraphs

    @property
    def params(self) -> list[torch.Tensor]:
        return self.guard.params

    @property
    def calls(self) -> int:
        """Successful guarded calls, all windows together."""
        return self.guard.calls

    def mark_varying_input(self, component: str, tensor: torch.Tensor) -> torch.Tensor:
        """Mark the input of ``component`` whose batch shapes vary (aspect-ratio buckets), as its
        current plan allows (see dynamic_dims); returns the same tensor."""
        plan = self.components[component].plan
        return mark_input(tensor, *input_dims(plan, self.config.dynamic))

    def mark_varying_length(self, component: str, tensor: torch.Tensor, dim: int = 0
                            ) -> torch.Tensor:
        """Mark a sequence length of ``component``'s input that varies from batch to batch
        (a caption's tokens) dynamic up front, when ``component`` is compiled and
        compile.dynamic is AUTO: a whole compiled model then compiles once for every length
        instead of once, then again symbolic, at the second; returns the same tensor."""
        plan = self.components[component].plan
        if plan.compiled and self.config.dynamic == DynamicShapes.AUTO:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return tensor

    def after_step(self) -> Path | None:
        """After an optimizer step: write the run's compile bundle when graphs were compiled
        since the last write (the first step's, a new shape's); the path written, or None."""
        bundles = self.applier.bundles  # None where no compiled component uses inductor
        if bundles is None or self.cache_dir is None:
            return None
        error = bundles.write_error
        stats = [self.tracker.component(name) for name in self.components]
        written = bundles.write_if_new(sum(s.compiles for s in stats),
                                       Path(self.cache_dir).expanduser().resolve(),
                                       self._compile_seconds(),
                                       cold=compiled_cold(sum(s.cache_hits for s in stats),
                                                          sum(s.cache_misses for s in stats)))
        if written is not None:
            self.reporter.bundle_event(f"compile bundle written: {written}", "done")
        elif bundles.write_error and bundles.write_error != error:
            self.reporter.bundle_event("compile bundle not written (training goes on): "
                                       f"{bundles.write_error}", "warning")
        return written

    def bundle_record(self) -> dict | None:
        """run.json's ``compile_bundle``: what was looked for, loaded and written; None when
        bundles are off or nothing compiles with inductor."""
        bundles = self.applier.bundles
        return bundles.record(self._compile_seconds()) if bundles is not None else None

    def _compile_seconds(self) -> float:
        return sum(self.tracker.component(name).compile_seconds for name in self.components)

    def close(self) -> None:
        """Undo every compilation and the engine's process-wide settings (cache folders,
        recompile limit, dynamo callbacks)."""
        self.applier.close()

    # -- guarded calls --------------------------------------------------------------------------
    def window(self) -> GuardedWindow:
        """A new accumulation window; open it when the gradients are clear (after zero_grad)."""
        return GuardedWindow(self.guard)

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

    # -- report ---------------------------------------------------------------------------------
    def report(self) -> dict[str, dict[str, Any]]:
        """Per component, the run record's compile section (keys are stable)."""
        return self.reporter.report()
