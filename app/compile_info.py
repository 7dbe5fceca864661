"""What the Advanced Options panel's description line says about the chosen compile backend.

The description is the backend row's (`modules.compile.backends.BACKENDS`: each row carries its
label and description); what `torch.compile` gets and what runs on this machine, and why, is the
plan training applies (`modules.train.recipe.compile_guard.compile_plans`). This module only renders.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modules.frontend import BACKENDS
from modules.config.schema import CompileBackend


def backend_description(backend: CompileBackend) -> str:
    """The backend's one-line description, from its row."""
    return BACKENDS[backend].description


def _format_options(options: Mapping[str, Any]) -> str:
    return ", ".join(f'"{k}": {v!r}' for k, v in options.items())


def torch_compile_call(plan: Any) -> str:
    """The backend and options of a plan's ``torch.compile`` call, as code (the other keywords,
    fullgraph, dynamic and the recompile limit, are in the run record)."""
    if not plan.compiled:
        return "eager: torch.compile is not called"
    kwargs = plan.torch_compile_kwargs
    args = ["model"]
    if kwargs.get("backend"):
        args.append(f'backend="{kwargs["backend"]}"')
    if kwargs.get("options"):
        args.append("options={" + _format_options(kwargs["options"]) + "}")
    call = "torch.compile(" + ", ".join(args) + ")"
    return call if kwargs.get("backend") else call + "  (torch's default backend: inductor)"


def describe_plan(backend: CompileBackend, plans: Mapping[str, Any]) -> str:
    """The description line: the backend's row, then what the plan will run here and why.

    The ``torch.compile`` call shown is the first selected component's (the UNet by default);
    what runs differently from what was asked is said for every selected component.
    """
    from modules.frontend import COMPONENT_LABELS  # imports torch: after the window is up

    lines = [backend_description(backend)]
    asked = [plan for plan in plans.values() if plan.requested != CompileBackend.NONE]
    if backend == CompileBackend.NONE:
        lines.append("→ eager: torch.compile is not called")
    elif not asked:
        lines.append("→ no component is selected: nothing is compiled")
    else:
        lines.append(f"→ {torch_compile_call(asked[0])}")
        for plan in asked:
            who = f"{COMPONENT_LABELS[plan.component]}: " if len(asked) > 1 else ""
            lines.extend(who + reason for reason in plan.reasons())
    return "\n".join(lines)


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


def bundle_text(lookup: Any, known: bool) -> str:
    """The Advanced Options line on the compile bundle a run of these settings would start
    from (``lookup``: a `Lookup`, None when bundles do not apply; ``known``: the machine was
    detected, so the lookup was made)."""
    if not known:
        return "Compile bundle: looked up once the engine has loaded"
    if lookup is None:
        return "Compile bundle: none used (bundles off, or nothing compiles with inductor)"
    if lookup.status == "hit":
        return f"Compile bundle for these settings: {lookup.path.name} (the first step starts warm)"
    if lookup.status == "mismatch":
        return (f"No compile bundle for these settings on this machine; closest "
                f"{lookup.path.name}: {lookup.why}")
    if lookup.status == "damaged":
        return f"Compile bundle damaged, not used: {lookup.why}"
    return "No compile bundle for these settings yet: the first run writes one"
