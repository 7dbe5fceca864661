"""What to compile, how: a pure function from (config, facts) to a plan per component.

Everything the compile engine decides before the first step is decided here, so that each
decision is CPU-testable for every preset: the backend that can run on this machine, the exact
``torch.compile`` arguments, the recompile limit and whether CUDA graphs stay on given how the
component is trained. Every front end asks `build_plan` with the same `CompileFacts` (the
machine and how the run trains each component; ``modules.train.recipe.compile_guard.compile_facts``
derives them from a config): training, *Check compilation*, the GUI's summary line and the
benchmark, so none of them can report a decision the run does not make.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modules.compile.backends import (BACKENDS, INDUCTOR, BackendRow, fallback_chain,
                                      merged_inductor_options, torch_compile_kwargs)
from modules.compile.capabilities import Capabilities, backend_problem
from modules.config.schema import (CompileBackend, CompileConfig, CompileMode, CompileScope,
                                   DynamicShapes)

COMPONENTS: tuple[str, ...] = ("unet", "text_encoder", "vae")
COMPONENT_LABELS: dict[str, str] = {"unet": "UNet", "text_encoder": "text encoder", "vae": "VAE"}

# Dynamo's default limit is 8 compiles per code object. REGIONAL compiles many blocks through
# one code object per block class (``forward``): a real SD UNet has more than 8 ResnetBlock2D
# channel layouts (and the VAE's resnets share the same code). FULL compiles one graph per
# aspect-ratio bucket where sizes stay static (SDXL has nine). Past the limit the code runs
# eager, so every compiled plan raises it: per call with ``torch.compile(recompile_limit=...)``
# where torch has it (>= 2.12), else through dynamo's process-wide ``recompile_limit``, set while
# the engine is applied and restored after.
RECOMPILE_LIMIT = 64

# Known compiler limits, as data: (backend family, scope, components) that cannot take symbolic
# sizes in some dimensions, and why. Measured on torch 2.11 and 2.13 (docs/compilation.md).
SPATIAL_DYNAMIC_LIMITS: tuple[tuple[str, CompileScope, frozenset[str], str], ...] = (
    (INDUCTOR, CompileScope.FULL, frozenset({"unet", "vae"}),
     "inductor cannot compile a whole UNet or VAE with symbolic height and width (torch 2.11 "
     "and 2.13: InductorError 'cannot determine truth value of Relational' in "
     "ir.get_stride_order)"),
)

CUDAGRAPH_OPTION = "triton.cudagraphs"
# https://github.com/pytorch/pytorch/issues/154306 (open): activation checkpointing that wraps a
# CUDA-graphed compiled region recomputes it during backward, and the replay overwrites memory
# the backward still reads; torch's own check fires only after the damage.
CHECKPOINT_CUDAGRAPH_REASON = (
    "CUDA graphs turned off: gradient checkpointing around regionally compiled blocks is "
    "unsafe with CUDA graphs (pytorch#154306); FULL scope keeps them")


class CompileError(RuntimeError):
    """A compile failure that strict mode (or an exhausted fallback chain) makes fatal."""


@dataclass(frozen=True)
class ComponentTraining:
    """How a component is trained, as far as compiling it is concerned."""
    trained: bool = False
    gradient_checkpointing: bool = False  # on for this component (only trained ones use it)
    accumulation: int = 1                 # micro-steps per optimizer step


@dataclass(frozen=True)
class CompileFacts:
    """What a plan depends on beyond ``compile.*``: the machine, and how the run trains each
    component (a component not named is not trained)."""
    capabilities: Capabilities
    training: Mapping[str, ComponentTraining] = field(default_factory=dict)

    def of(self, component: str) -> ComponentTraining:
        return self.training.get(component, ComponentTraining())


@dataclass(frozen=True)
class CompilePlan:
    """What will run for one component, and why it differs from what was asked.

    ``effective`` is the backend that will run; ``fallback_reason`` says why it is not
    ``requested`` (None when it is), ``cudagraphs_off`` why CUDA graphs the backend asks for are
    off, ``dynamic_static_spatial`` why DYNAMIC shapes keep height and width static; ``degraded``
    is every such reason in one line, as the run record writes it.
    """
    component: str
    requested: CompileBackend
    effective: CompileBackend
    scope: CompileScope
    torch_compile_kwargs: dict[str, Any]
    inductor_options: dict[str, Any]
    degraded: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    # dynamo's process-wide recompile limit to raise to, where torch.compile has no per-call one
    process_recompile_limit: int | None = None
    # gradients preallocated and zeroed in place, never taken from a CUDA graph's output
    persistent_grads: bool = False
    # height and width of the component's input kept static (one compile per size): why, or None
    static_spatial: str | None = None
    fallback_reason: str | None = None
    cudagraphs_off: str | None = None
    # why compile.dynamic DYNAMIC runs as AUTO with static height and width here, or None
    dynamic_static_spatial: str | None = None

    @property
    def compiled(self) -> bool:
        return self.effective != CompileBackend.NONE

    @property
    def cudagraphs(self) -> bool:
        return bool(self.inductor_options.get(CUDAGRAPH_OPTION))

    def reasons(self) -> list[str]:
        """What runs differently from what was asked, as sentences for a front end."""
        said: list[str] = []
        if self.fallback_reason:
            said.append(f"{self.requested.value} runs as {self.effective.value} here: "
                        f"{self.fallback_reason}")
        if self.cudagraphs_off:
            said.append(self.cudagraphs_off)
        if self.dynamic_static_spatial:
            said.append(self.dynamic_static_spatial)
        return said


def next_backend(current: CompileBackend, caps: Capabilities) -> CompileBackend:
    """The backend after ``current`` in its row's fallback chain that can run on ``caps``."""
    for candidate in fallback_chain(current)[1:]:
        if backend_problem(candidate, caps) is None:
            return candidate
    return CompileBackend.NONE


def usable_backend(requested: CompileBackend, caps: Capabilities) -> tuple[CompileBackend, str | None]:
    """``requested``, or the first backend down the chain that runs here, with the reason."""
    problem = backend_problem(requested, caps)
    if problem is None:
        return requested, None
    return next_backend(requested, caps), problem


def cudagraph_rules(options: dict[str, Any], caps: Capabilities, scope: CompileScope,
                    training: ComponentTraining) -> tuple[dict[str, Any], str | None, bool]:
    """(options, why CUDA graphs were turned off or None, persistent gradients?).

    CUDA graphs exist only on CUDA, and break two training settings the presets use:
    checkpointing around regional blocks (turned off, reported) and gradient accumulation with
    ``zero_grad(set_to_none=True)``: a CUDA-graphed backward's output becomes ``.grad`` and the
    next micro-step's replay overwrites it (pytorch#169545). The second is made safe instead of
    off: a trained component's gradients are allocated before capture and zeroed in place, so
    autograd adds each graph output into them and never keeps the graph's own memory.
    """
    if not options.get(CUDAGRAPH_OPTION):
        return options, None, False
    off = {**options, CUDAGRAPH_OPTION: False}
    if caps.device_type != "cuda":
        return off, "CUDA graphs (triton.cudagraphs) need a CUDA GPU; turned off", False
    if (training.trained and training.gradient_checkpointing
            and scope == CompileScope.REGIONAL):
        return off, CHECKPOINT_CUDAGRAPH_REASON, False
    return options, None, training.trained


def spatial_dynamic_limit(row: BackendRow, scope: CompileScope, component: str) -> str | None:
    """Why ``component`` must keep static height and width under ``row``'s family and ``scope``."""
    for family, limited_scope, components, reason in SPATIAL_DYNAMIC_LIMITS:
        if row.family == family and scope == limited_scope and component in components:
            return reason
    return None


def build_plan(config: CompileConfig, facts: CompileFacts,
               table: Mapping[CompileBackend, BackendRow] = BACKENDS) -> dict[str, CompilePlan]:
    """Every component's plan under ``config`` with ``facts``: the one question each front end
    asks (training, Check compilation, the GUI's summary line, the benchmark)."""
    return {name: plan_component(config, name, facts, table) for name in COMPONENTS}


def plan_component(config: CompileConfig, component: str, facts: CompileFacts,
                   table: Mapping[CompileBackend, BackendRow] = BACKENDS,
                   backend: CompileBackend | None = None) -> CompilePlan:
    """The plan for ``component`` under ``config`` with ``facts``.

    ``backend`` overrides the configured one (used when falling back). A component that is not
    selected in the config gets effective NONE.
    """
    if component not in COMPONENTS:
        raise ValueError(f"unknown compile component {component!r}; expected one of {COMPONENTS}")
    caps = facts.capabilities
    selected = config.denoiser if component == "unet" else getattr(config, component)
    requested = config.backend if selected else CompileBackend.NONE
    wanted = backend if backend is not None else requested
    effective, fallback_reason = usable_backend(wanted, caps)
    degraded = (f"{fallback_reason}; using {effective.value} instead" if fallback_reason
                else None)
    row = table[effective]
    if not row.compiles:
        return CompilePlan(component, requested, CompileBackend.NONE, config.scope, {}, {},
                           degraded, fallback_reason=fallback_reason)
    notes: list[str] = []
    options = merged_inductor_options(row, config.mode)
    options, cudagraph_note, persistent_grads = cudagraph_rules(options, caps, config.scope,
                                                                facts.of(component))
    if cudagraph_note:
        degraded = f"{degraded}; {cudagraph_note}" if degraded else cudagraph_note
    if persistent_grads:
        notes.append("CUDA graphs on a trained component: its gradients are allocated before "
                     "capture and zeroed in place (pytorch#169545)")
    if not row.inductor and config.mode != CompileMode.DEFAULT:
        notes.append(f"mode {config.mode.value} does not apply to {effective.value} "
                     "(it only sets inductor options); ignored")
    kwargs = torch_compile_kwargs(row, config, options)
    static_spatial = spatial_dynamic_limit(row, config.scope, component)
    why = None
    if static_spatial and config.dynamic == DynamicShapes.DYNAMIC:
        kwargs["dynamic"] = None  # sizes become dynamic where they vary, except these
        why = (f"dynamic shapes DYNAMIC turned into AUTO with static height and width: "
               f"{static_spatial}")
        degraded = f"{degraded}; {why}" if degraded else why
    process_limit = None
    if caps.per_call_recompile_limit:
        kwargs["recompile_limit"] = RECOMPILE_LIMIT
    else:  # run.json says where the limit was set (report "recompile_limit")
        process_limit = RECOMPILE_LIMIT
    return CompilePlan(component, requested, effective, config.scope, kwargs,
                       dict(options) if row.inductor else {}, degraded, tuple(notes),
                       process_limit, persistent_grads, static_spatial, fallback_reason,
                       cudagraph_note, why)
