"""The compile backends as data: one row per backend, read wherever a fact about one is needed.

A row says what the backend is called in the window (``label``) and what it is for
(``description``), what ``torch.compile`` gets for it (``backend``, ``options``), its family (an
inductor backend takes inductor options and ``mode``, writes inductor's cache and shares
inductor's known limits) and what it needs of the machine (``cuda_only``). The plan, the engine's
report, the capability check, the GUI's labels and descriptions and the benchmark read these rows;
adding a backend is adding a row (and its `CompileBackend` member).

The rows are the product design (docs/compilation.md): DEFAULT is torch's default backend
(inductor) with no extra options; INDUCTOR adds autotuning without CUDA graphs; TRITON is *also*
``backend="inductor"`` (torch has no backend named "triton") with CUDA graphs on top; AOT_EAGER
runs AOTAutograd graphs with eager kernels. ``epilogue_fusion`` and ``shape_padding`` are written
out in the rows as the design maps them, but they are torch's own defaults (torch 2.11 and 2.13,
checked by tests/compile/test_plan.py), so they are not a difference between backends.

This module imports no torch at import time: the window reads labels and descriptions before
torch is loaded.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modules.config.schema import CompileBackend, CompileConfig, CompileMode, DynamicShapes

INDUCTOR = "inductor"
EAGER = "eager"


@dataclass(frozen=True)
class BackendRow:
    """One `CompileBackend`: how it is handed to ``torch.compile`` and what is said about it.

    ``backend`` None means "torch's default backend" (the key is then not passed at all).
    ``inductor`` says whether the backend is of the inductor family: it takes inductor options
    and ``mode``, uses inductor's cache and shares inductor's known limits.
    ``compiles`` False is the eager row (``torch.compile`` is not called).
    ``cuda_only`` is why the backend needs a CUDA GPU, or None when it does not.
    ``falls_back_to`` is the backend a failing component tries next (None: the end, eager).
    """
    backend: str | None
    inductor: bool
    options: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""
    description: str = ""
    compiles: bool = True
    cuda_only: str | None = None
    falls_back_to: CompileBackend | None = None

    @property
    def family(self) -> str:
        """"inductor", "eager" (not compiled), or the dynamo backend's own name."""
        if not self.compiles:
            return EAGER
        return INDUCTOR if self.inductor else str(self.backend)


BACKENDS: dict[CompileBackend, BackendRow] = {
    CompileBackend.NONE: BackendRow(
        backend=None, inductor=False, compiles=False, label="None (eager)",
        description="No compilation: plain eager PyTorch. No start-up cost; use it to debug."),
    CompileBackend.DEFAULT: BackendRow(
        backend=None, inductor=True, label="Default", falls_back_to=CompileBackend.AOT_EAGER,
        description="torch's default backend (inductor) with no extra options: the safe first "
                    "choice."),
    CompileBackend.INDUCTOR: BackendRow(
        backend="inductor", inductor=True, label="Inductor",
        falls_back_to=CompileBackend.DEFAULT,
        options={"max_autotune": True, "epilogue_fusion": True, "triton.cudagraphs": False},
        description="Inductor with max autotune, CUDA graphs off (its other options are "
                    "torch's defaults): for long runs on modern hardware."),
    # There is no torch backend called "triton": TRITON is inductor (which generates triton
    # kernels on GPUs) plus CUDA graphs.
    CompileBackend.TRITON: BackendRow(
        backend="inductor", inductor=True, label="Triton + CUDA graphs",
        falls_back_to=CompileBackend.INDUCTOR,
        options={"triton.cudagraphs": True, "shape_padding": True, "max_autotune": True,
                 "epilogue_fusion": True},
        cuda_only="CUDA graphs do not exist on the CPU",
        description="Inductor with max autotune plus CUDA graphs (there is no torch backend "
                    "named \"triton\"): fastest on NVIDIA GPUs, slowest to compile."),
    CompileBackend.AOT_EAGER: BackendRow(
        backend="aot_eager", inductor=False, label="AOT eager (debug)",
        falls_back_to=CompileBackend.NONE,
        description="AOTAutograd graphs run with eager kernels: little speed-up, low overhead "
                    "and memory; the stable fallback."),
}

# Inductor options some rows write out that are torch's own defaults (docs/compilation.md):
# the rows keep them as the design maps them, but no text may call them a difference between
# backends. tests/compile/test_plan.py reads torch's config so this cannot go stale.
TORCH_DEFAULT_OPTIONS: frozenset[str] = frozenset({"epilogue_fusion", "shape_padding"})

def fallback_chain(start: CompileBackend,
                   table: Mapping[CompileBackend, BackendRow] | None = None
                   ) -> tuple[CompileBackend, ...]:
    """``start`` and the backends a failing component falls back through after it, read from
    the rows' ``falls_back_to`` (the capability check may skip some)."""
    rows = BACKENDS if table is None else table
    chain = [start]
    while (following := rows[chain[-1]].falls_back_to) is not None:
        if following in chain:
            raise ValueError(f"the fallback chain from {start.value} loops at {following.value}")
        chain.append(following)
    return tuple(chain)


# The whole chain, from the backend nothing falls back to (docs and tests show it).
FALLBACK_CHAIN: tuple[CompileBackend, ...] = fallback_chain(next(
    b for b in BACKENDS if all(row.falls_back_to != b for row in BACKENDS.values())))

MODE_NAMES: dict[CompileMode, str] = {
    CompileMode.DEFAULT: "default",
    CompileMode.REDUCE_OVERHEAD: "reduce-overhead",
    CompileMode.MAX_AUTOTUNE: "max-autotune",
    CompileMode.MAX_AUTOTUNE_NO_CUDAGRAPHS: "max-autotune-no-cudagraphs",
}

DYNAMIC_FLAGS: dict[DynamicShapes, bool | None] = {
    DynamicShapes.DYNAMIC: True, DynamicShapes.AUTO: None, DynamicShapes.STATIC: False}


def unknown_inductor_options(options: Mapping[str, Any]) -> list[str]:
    """Option keys that the installed torch's inductor config does not have."""
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    return sorted(key for key in options if key.replace("-", "_") not in known)


def check_table(table: Mapping[CompileBackend, BackendRow] = BACKENDS) -> None:
    """Raise ValueError naming every option key in ``table`` this torch does not know.

    ``torch.compile`` itself would only fail at the first forward; a renamed inductor option must
    stop the run before any work is done, not turn into a silent no-op.
    """
    problems = [f"compile backend {backend.value}: inductor option {key!r}"
                for backend, row in table.items()
                for key in unknown_inductor_options(row.options)]
    if problems:
        import torch
        raise ValueError(f"unknown inductor options for torch {torch.__version__}: "
                         + "; ".join(problems))


def merged_inductor_options(row: BackendRow, mode: CompileMode) -> dict[str, Any]:
    """The inductor options for ``row`` under ``mode``.

    ``torch.compile`` refuses ``mode`` together with ``options``, so the mode is folded into the
    options: start from ``torch._inductor.list_mode_options(mode)`` and overlay the row on it.
    The row wins on conflicts because it is the backend's documented contract (INDUCTOR means
    "no CUDA graphs" even under REDUCE_OVERHEAD); the mode only adds what the row leaves unset.
    """
    if not row.inductor:
        return {}
    from torch._inductor import list_mode_options

    merged = dict(list_mode_options(MODE_NAMES[mode]))
    merged.update(row.options)
    return merged


def torch_compile_kwargs(row: BackendRow, compile_config: CompileConfig,
                         options: Mapping[str, Any]) -> dict[str, Any]:
    """The exact keyword arguments handed to ``torch.compile`` / ``nn.Module.compile``.

    ``mode`` is never passed (it lives in ``options``, see `merged_inductor_options`), and
    ``options`` only when there are some and the backend is inductor.
    """
    kwargs: dict[str, Any] = {}
    if row.backend is not None:
        kwargs["backend"] = row.backend
    kwargs["fullgraph"] = bool(compile_config.fullgraph)
    kwargs["dynamic"] = DYNAMIC_FLAGS[compile_config.dynamic]
    if row.inductor and options:
        kwargs["options"] = dict(options)
    return kwargs
