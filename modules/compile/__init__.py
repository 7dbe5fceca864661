"""The compile engine: backend table, per-component plans, guarded first steps, reports.

The trainer builds a `CompileEngine`, calls ``apply()``, runs each optimizer step's micro-steps
through a guarded ``window()``, and writes ``report()`` into the run record. See
docs/compilation.md.
"""
from modules.compile.backends import BACKENDS, FALLBACK_CHAIN, BackendRow, check_table
from modules.compile.cache import compile_cache_folder, use_compile_cache
from modules.compile.capabilities import Capabilities, backend_problem, detect_capabilities
from modules.compile.engine import CompileEngine
from modules.compile.explain import explain, explain_component, format_explanation
from modules.compile.plan import (COMPONENTS, CompileError, CompilePlan, ComponentTraining,
                                  build_plan)

__all__ = [
    "BACKENDS", "FALLBACK_CHAIN", "BackendRow", "COMPONENTS", "Capabilities", "CompileEngine",
    "CompileError", "CompilePlan", "ComponentTraining", "backend_problem", "build_plan",
    "check_table", "compile_cache_folder", "detect_capabilities", "explain",
    "explain_component", "format_explanation", "use_compile_cache",
]
