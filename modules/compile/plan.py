"""What to compile, how: a pure function from (config, component, capabilities, training) to a plan.

Everything the compile engine decides before the first step is decided here, so that each
decision is CPU-testable for every preset: the backend that can run on this machine, the exact
``torch.compile`` arguments, the recompile limit and whether CUDA graphs stay on given how the
component is trained.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modules.compile.backends import (BACKENDS, FALLBACK_CHAIN, BackendRow,
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

# Known compiler limits, as data: (backends, scope, components) that cannot take symbolic
# sizes in some dimensions, and why. Measured on torch 2.11 and 2.13 (docs/compilation.md).
SPATIAL_DYNAMIC_LIMITS: tuple[tuple[frozenset[CompileBackend], CompileScope, frozenset[str], str], ...] = (
    (frozenset({CompileBackend.DEFAULT, CompileBackend.INDUCTOR, CompileBackend.TRITON}),
     CompileScope.FULL, frozenset({"unet", "vae"}),
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
class CompilePlan:
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

    @property
    def compiled(self) -> bool:
        return self.effective != CompileBackend.NONE

    @property
    def cudagraphs(self) -> bool:
        return bool(self.inductor_options.get(CUDAGRAPH_OPTION))


def next_backend(current: CompileBackend, caps: Capabilities) -> CompileBackend:
    """The backend after ``current`` in the fallback chain that can run on ``caps``."""
    start = FALLBACK_CHAIN.index(current) + 1
    for candidate in FALLBACK_CHAIN[start:]:
        if backend_problem(candidate, caps) is None:
            return candidate
    return CompileBackend.NONE


def usable_backend(requested: CompileBackend, caps: Capabilities) -> tuple[CompileBackend, str | None]:
    """``requested``, or the first backend down the chain that runs here, with the reason."""
    problem = backend_problem(requested, caps)
    if problem is None:
        return requested, None
    effective = next_backend(requested, caps)
    return effective, f"{problem}; using {effective.value} instead"


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


def spatial_dynamic_limit(backend: CompileBackend, scope: CompileScope,
                          component: str) -> str | None:
    """Why ``component`` must keep static height and width under ``backend`` and ``scope``."""
    for backends, limited_scope, components, reason in SPATIAL_DYNAMIC_LIMITS:
        if backend in backends and scope == limited_scope and component in components:
            return reason
    return None


def build_plan(config: CompileConfig, component: str, caps: Capabilities,
               table: Mapping[CompileBackend, BackendRow | None] = BACKENDS,
               backend: CompileBackend | None = None,
               training: ComponentTraining = ComponentTraining()) -> CompilePlan:
    """The plan for ``component`` under ``config`` on a machine with ``caps``.

    ``backend`` overrides the configured one (used when falling back). A component that is not
    selected in the config gets effective NONE. ``training`` says how the run trains it.
    """
    if component not in COMPONENTS:
        raise ValueError(f"unknown compile component {component!r}; expected one of {COMPONENTS}")
    selected = config.denoiser if component == "unet" else getattr(config, component)
    requested = config.backend if selected else CompileBackend.NONE
    wanted = backend if backend is not None else requested
    effective, degraded = usable_backend(wanted, caps)
    row = table[effective]
    if row is None:
        return CompilePlan(component, requested, CompileBackend.NONE, config.scope, {}, {}, degraded)
    notes: list[str] = []
    options = merged_inductor_options(row, config.mode)
    options, cudagraph_note, persistent_grads = cudagraph_rules(options, caps, config.scope,
                                                                training)
    if cudagraph_note:
        degraded = f"{degraded}; {cudagraph_note}" if degraded else cudagraph_note
    if persistent_grads:
        notes.append("CUDA graphs on a trained component: its gradients are allocated before "
                     "capture and zeroed in place (pytorch#169545)")
    if not row.inductor and config.mode != CompileMode.DEFAULT:
        notes.append(f"mode {config.mode.value} does not apply to {effective.value} "
                     "(it only sets inductor options); ignored")
    kwargs = torch_compile_kwargs(row, config, options)
    static_spatial = spatial_dynamic_limit(effective, config.scope, component)
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
                       process_limit, persistent_grads, static_spatial)
