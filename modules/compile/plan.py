"""What to compile, how: a pure function from (config, component, capabilities) to a plan."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modules.compile.backends import (BACKENDS, FALLBACK_CHAIN, BackendRow,
                                      merged_inductor_options, torch_compile_kwargs)
from modules.compile.capabilities import Capabilities, backend_problem
from modules.config.schema import CompileBackend, CompileConfig, CompileMode, CompileScope

COMPONENTS: tuple[str, ...] = ("unet", "text_encoder", "vae")
COMPONENT_LABELS: dict[str, str] = {"unet": "UNet", "text_encoder": "text encoder", "vae": "VAE"}

# REGIONAL compiles many blocks through one code object per block class (``forward``), and
# dynamo's default limit of 8 compiles per code object is shared by all of them: a real SD UNet
# has more than 8 ResnetBlock2D channel layouts (and the VAE's resnets share the same code), so
# the blocks past the limit would silently run eager. REGIONAL therefore raises the limit for its
# own torch.compile calls (the ``recompile_limit`` argument, torch >= 2.10).
REGIONAL_RECOMPILE_LIMIT = 64


class CompileError(RuntimeError):
    """A compile failure that strict mode (or an exhausted fallback chain) makes fatal."""


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

    @property
    def compiled(self) -> bool:
        return self.effective != CompileBackend.NONE


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


def _cudagraph_free(options: dict[str, Any], caps: Capabilities) -> tuple[dict[str, Any], str | None]:
    """CUDA graphs only exist on CUDA; a mode that asks for them elsewhere loses them, reported."""
    if caps.device_type == "cuda" or not options.get("triton.cudagraphs"):
        return options, None
    return ({**options, "triton.cudagraphs": False},
            "CUDA graphs (triton.cudagraphs) need a CUDA GPU; turned off")


def build_plan(config: CompileConfig, component: str, caps: Capabilities,
               table: Mapping[CompileBackend, BackendRow | None] = BACKENDS,
               backend: CompileBackend | None = None) -> CompilePlan:
    """The plan for ``component`` under ``config`` on a machine with ``caps``.

    ``backend`` overrides the configured one (used when falling back). A component that is not
    selected in the config gets effective NONE.
    """
    if component not in COMPONENTS:
        raise ValueError(f"unknown compile component {component!r}; expected one of {COMPONENTS}")
    requested = config.backend if getattr(config, component) else CompileBackend.NONE
    wanted = backend if backend is not None else requested
    effective, degraded = usable_backend(wanted, caps)
    row = table[effective]
    if row is None:
        return CompilePlan(component, requested, CompileBackend.NONE, config.scope, {}, {}, degraded)
    notes: list[str] = []
    options = merged_inductor_options(row, config.mode)
    options, cudagraph_note = _cudagraph_free(options, caps)
    if cudagraph_note:
        degraded = f"{degraded}; {cudagraph_note}" if degraded else cudagraph_note
    if not row.inductor and config.mode != CompileMode.DEFAULT:
        notes.append(f"mode {config.mode.value} does not apply to {effective.value} "
                     "(it only sets inductor options); ignored")
    kwargs = torch_compile_kwargs(row, config, options)
    if config.scope == CompileScope.REGIONAL:
        kwargs["recompile_limit"] = REGIONAL_RECOMPILE_LIMIT
    return CompilePlan(component, requested, effective, config.scope, kwargs,
                       dict(options) if row.inductor else {}, degraded, tuple(notes))
