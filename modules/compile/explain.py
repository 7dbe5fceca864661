"""Why a component splits into several graphs: ``torch._dynamo.explain`` as a plain dict.

Used by the CLI explain script and the GUI's "Check compilation" button; both print
`format_explanation(explain(...))`. The plan shown is `build_plan`'s with the run's facts, the
one training applies.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from modules.compile.plan import COMPONENT_LABELS, CompileFacts, build_plan
from modules.compile.regions import REPEATED_BLOCKS, compile_targets
from modules.config.schema import CompileConfig

# (args, kwargs) for one call of a component
ExampleInputs = tuple[tuple[Any, ...], dict[str, Any]]


def explain_component(module: nn.Module, example_inputs: tuple[Any, ...] | ExampleInputs,
                      example_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Graph count, graph breaks with their reasons and user source lines, for one call.

    Runs the module once under dynamo's explain backend (no code generation, so it is quick)
    and resets dynamo before and after so it neither sees nor leaves compiled frames.
    """
    import torch._dynamo

    args, kwargs = _split(example_inputs, example_kwargs)
    torch._dynamo.reset()
    try:
        result = torch._dynamo.explain(module)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    return {
        "graphs": result.graph_count,
        "graph_breaks": result.graph_break_count,
        "ops": result.op_count,
        "breaks": [{"reason": reason.reason.strip(),
                    "where": [f"{frame.filename}:{frame.lineno} in {frame.name}"
                              for frame in reason.user_stack]}
                   for reason in result.break_reasons],
    }


def _split(inputs: Any, kwargs: Mapping[str, Any] | None) -> tuple[tuple[Any, ...], dict]:
    if (kwargs is None and isinstance(inputs, tuple) and len(inputs) == 2
            and isinstance(inputs[0], tuple) and isinstance(inputs[1], dict)):
        return inputs[0], dict(inputs[1])
    return tuple(inputs), dict(kwargs or {})


def _block_inputs(root: nn.Module, blocks: list[nn.Module],
                  example: ExampleInputs) -> list[tuple[nn.Module, ExampleInputs]]:
    """The first call's inputs of one block per class (REGIONAL explains blocks, not the root)."""
    import torch

    seen: dict[type, tuple[nn.Module, ExampleInputs]] = {}

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault(type(module), (module, (args, kwargs)))

    handles = [block.register_forward_pre_hook(capture, with_kwargs=True) for block in blocks]
    try:
        with torch.no_grad():
            root(*example[0], **example[1])
    finally:
        for handle in handles:
            handle.remove()
    return list(seen.values())


def explain(config: CompileConfig, components: Mapping[str, tuple[nn.Module, ExampleInputs]],
            facts: CompileFacts, blocks: Mapping[str, tuple[str, ...]] = REPEATED_BLOCKS
            ) -> dict[str, Any]:
    """Per component: its plan under ``config`` with ``facts`` and what dynamo makes of it.

    ``components`` maps "unet" / "text_encoder" / "vae" to (module, (args, kwargs)). With
    REGIONAL scope each distinct block class is explained with the inputs it saw in one call;
    ``blocks``: the block classes REGIONAL compiles per component, as training is given them
    (the denoiser's are its family's).
    """
    plans = build_plan(config, facts)
    out: dict[str, Any] = {}
    for name, (module, example) in components.items():
        plan = plans[name]
        entry: dict[str, Any] = {"label": COMPONENT_LABELS[name],
                                 "requested": plan.requested.value,
                                 "effective": plan.effective.value, "degraded": plan.degraded,
                                 "cudagraphs": plan.cudagraphs,
                                 "torch_compile_kwargs": plan.torch_compile_kwargs, "regions": []}
        example = _split(example, None)
        targets, note = compile_targets(name, [module], config.scope, blocks)
        entry["scope_note"] = note
        if targets == [module] or note:
            entry["regions"].append({"module": type(module).__name__,
                                     **explain_component(module, example)})
        else:
            for block, block_example in _block_inputs(module, targets, example):
                entry["regions"].append({"module": type(block).__name__,
                                         **explain_component(block, block_example)})
        out[name] = entry
    return out


def format_explanation(explanation: Mapping[str, Any]) -> str:
    """`explain`'s result as text for a terminal or a dialog."""
    lines: list[str] = []
    for entry in explanation.values():
        lines.append(f"{entry['label']}: {entry['requested']} -> {entry['effective']}"
                     + (", CUDA graphs on" if entry["cudagraphs"] else "")
                     + (f" (degraded: {entry['degraded']})" if entry["degraded"] else ""))
        for region in entry["regions"]:
            lines.append(f"  {region['module']}: {region['graphs']} graph(s), "
                         f"{region['graph_breaks']} break(s), {region['ops']} ops")
            for brk in region["breaks"]:
                lines.append(f"    break: {brk['reason']}")
                lines.extend(f"      at {where}" for where in brk["where"][-2:])
    return "\n".join(lines)
