"""The compile engine: backend table, per-component plans, guarded first steps, reports.

The trainer builds a `CompileEngine`, calls ``apply()``, runs each micro-step through
``run_guarded(step_fn)``, and writes ``report()`` into the run record. See docs/compilation.md.
"""
from modules.compile.backends import BACKENDS, FALLBACK_CHAIN, BackendRow, check_table
from modules.compile.cache import load_portable_cache, save_portable_cache, use_compile_cache
from modules.compile.capabilities import Capabilities, backend_problem, detect_capabilities
from modules.compile.dynamic_dims import mark_latents_dynamic
from modules.compile.engine import CompileEngine
from modules.compile.explain import explain, explain_component, format_explanation
from modules.compile.plan import COMPONENTS, CompileError, CompilePlan, build_plan

__all__ = [
    "BACKENDS", "FALLBACK_CHAIN", "BackendRow", "COMPONENTS", "Capabilities", "CompileEngine",
    "CompileError", "CompilePlan", "backend_problem", "build_plan", "check_table",
    "detect_capabilities", "explain", "explain_component", "format_explanation",
    "load_portable_cache", "mark_latents_dynamic", "save_portable_cache", "use_compile_cache",
]
