"""The compile engine: backend table, per-component plans, guarded first steps, reports.

The trainer builds a `CompileEngine`, calls ``apply()``, runs each optimizer step's micro-steps
through a guarded ``window()``, and writes ``report()`` into the run record. See
docs/compilation.md.

The names below are loaded on first use (PEP 562), so that ``modules.compile.backends`` (the
backend rows: labels and descriptions the window shows before torch is imported) can be read
without importing torch; ``import modules.compile.engine`` loads the engine and torch. The
function ``explain`` is imported from ``modules.compile.explain``: its module has its name.
"""
from __future__ import annotations

import importlib
from typing import Any

_WHERE: dict[str, str] = {
    "BACKENDS": "backends", "FALLBACK_CHAIN": "backends", "BackendRow": "backends",
    "check_table": "backends",
    "compile_cache_folder": "cache", "use_compile_cache": "cache",
    "Capabilities": "capabilities", "backend_problem": "capabilities",
    "detect_capabilities": "capabilities",
    "CompileEngine": "engine",
    "explain_component": "explain", "format_explanation": "explain",
    "COMPONENTS": "plan", "CompileError": "plan", "CompileFacts": "plan", "CompilePlan": "plan",
    "ComponentTraining": "plan", "build_plan": "plan", "plan_component": "plan",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
