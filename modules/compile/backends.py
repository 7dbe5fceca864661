"""The compile backends as data: one row per backend, read by `torch_compile_kwargs`.

The rows are the product design (docs/compilation.md): DEFAULT is torch's default backend
(inductor) with no extra options; INDUCTOR adds autotuning and epilogue fusion without CUDA
graphs; TRITON is *also* ``backend="inductor"`` (torch has no backend named "triton") with CUDA
graphs and shape padding on top; AOT_EAGER runs AOTAutograd graphs with eager kernels.
Adding a backend is adding a row.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modules.config.schema import CompileBackend, CompileConfig, CompileMode, DynamicShapes


@dataclass(frozen=True)
class BackendRow:
    """How one `CompileBackend` is handed to ``torch.compile``.

    ``backend`` None means "torch's default backend" (the key is then not passed at all).
    ``inductor`` says whether the backend takes inductor options and ``mode``.
    """
    backend: str | None
    inductor: bool
    options: Mapping[str, Any] = field(default_factory=dict)


BACKENDS: dict[CompileBackend, BackendRow | None] = {
    CompileBackend.NONE: None,
    CompileBackend.DEFAULT: BackendRow(backend=None, inductor=True),
    CompileBackend.INDUCTOR: BackendRow(backend="inductor", inductor=True, options={
        "max_autotune": True, "epilogue_fusion": True, "triton.cudagraphs": False}),
    # There is no torch backend called "triton": TRITON is inductor (which generates triton
    # kernels on GPUs) plus CUDA graphs and shape padding.
    CompileBackend.TRITON: BackendRow(backend="inductor", inductor=True, options={
        "triton.cudagraphs": True, "shape_padding": True, "max_autotune": True,
        "epilogue_fusion": True}),
    CompileBackend.AOT_EAGER: BackendRow(backend="aot_eager", inductor=False),
}

# The order a failing component falls back through (the capability check may skip some).
FALLBACK_CHAIN: tuple[CompileBackend, ...] = (
    CompileBackend.TRITON, CompileBackend.INDUCTOR, CompileBackend.DEFAULT,
    CompileBackend.AOT_EAGER, CompileBackend.NONE)

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


def check_table(table: Mapping[CompileBackend, BackendRow | None] = BACKENDS) -> None:
    """Raise ValueError naming every option key in ``table`` this torch does not know.

    ``torch.compile`` itself would only fail at the first forward; a renamed inductor option must
    stop the run before any work is done, not turn into a silent no-op.
    """
    problems = [f"compile backend {backend.value}: inductor option {key!r}"
                for backend, row in table.items() if row is not None
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
