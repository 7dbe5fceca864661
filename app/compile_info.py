"""What each compile backend means, for the Advanced Options panel's description line.

The one-line descriptions are GUI text (a table here); what a backend hands to `torch.compile`
is read from the engine's table (`modules.compile.backends.BACKENDS`), so the two cannot drift.
"""
from __future__ import annotations

from typing import Any

from modules.config.schema import CompileBackend

BACKEND_DESCRIPTIONS: dict[CompileBackend, str] = {
    CompileBackend.NONE: "No compilation: plain eager PyTorch. No start-up cost; use it to debug.",
    CompileBackend.DEFAULT: "torch's default backend (inductor) with no extra options: the safe "
                            "first choice.",
    CompileBackend.INDUCTOR: "Inductor with max autotune and epilogue fusion, CUDA graphs off: "
                             "for long runs on modern hardware.",
    CompileBackend.TRITON: "Inductor plus CUDA graphs and shape padding (there is no torch "
                           "backend named \"triton\"): fastest on NVIDIA GPUs, slowest to compile.",
    CompileBackend.AOT_EAGER: "AOTAutograd graphs run with eager kernels: little speed-up, low "
                              "overhead and memory; the stable fallback.",
}


def _format_options(options: dict[str, Any]) -> str:
    return ", ".join(f'"{k}": {v!r}' for k, v in options.items())


def torch_compile_summary(backend: CompileBackend) -> str:
    """What the backend maps to in torch.compile, read from the engine's backend table."""
    from modules.frontend import BACKENDS  # imports torch: after the window is up
    row = BACKENDS.get(backend)
    if row is None:
        return "eager: torch.compile is not called"
    args = ["model"]
    if row.backend:
        args.append(f'backend="{row.backend}"')
    if row.options:
        args.append("options={" + _format_options(dict(row.options)) + "}")
    call = "torch.compile(" + ", ".join(args) + ")"
    return call if row.backend else call + "  (torch's default backend: inductor)"


def describe_backend(backend: CompileBackend) -> str:
    return f"{BACKEND_DESCRIPTIONS[backend]}\n→ {torch_compile_summary(backend)}"


def format_report(report: Any) -> str:
    """Text for whatever `explain` returns (an object with to_text/format, a dict, or str)."""
    for name in ("to_text", "format", "as_text"):
        method = getattr(report, name, None)
        if callable(method):
            return str(method())
    if isinstance(report, (dict, list)):
        import json
        return json.dumps(report, indent=2, default=str)
    return str(report)
