"""Compiled training with the cheap aot_eager backend: equal losses, keys, fallback, regions."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from modules.compile import BACKENDS, Capabilities, CompileEngine, CompileError, explain_component
from modules.compile.backends import BackendRow
from modules.config.schema import CompileBackend, CompileConfig, CompileScope, DynamicShapes
from modules.events import RecordingCallbacks

GPU = Capabilities.everything("cuda")  # forced, so no backend degrades in these tests


def aot_eager(scope=CompileScope.FULL, dynamic=DynamicShapes.STATIC, **kw) -> CompileConfig:
    return CompileConfig(backend=CompileBackend.AOT_EAGER, scope=scope, dynamic=dynamic, **kw)


def failing_table(fail_compile: str, fail_backward: str):
    """TRITON refuses to compile, INDUCTOR fails in backward, DEFAULT works (aot_eager)."""
    return {**BACKENDS,
            CompileBackend.TRITON: BackendRow(fail_compile, inductor=False),
            CompileBackend.INDUCTOR: BackendRow(fail_backward, inductor=False),
            CompileBackend.DEFAULT: BackendRow("aot_eager", inductor=False)}


def test_compiled_lora_training_matches_eager(make_one_level_unet, train):
    eager = train(make_one_level_unet(lora=True))
    unet = make_one_level_unet(lora=True)
    keys = list(unet.state_dict())
    callbacks = RecordingCallbacks()
    engine = CompileEngine(aot_eager(), {"unet": unet}, callbacks=callbacks, capabilities=GPU)
    engine.apply()
    compiled = train(unet, engine)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
    assert list(unet.state_dict()) == keys
    assert not any("_orig_mod" in key for key in unet.state_dict())
    report = engine.report()
    assert report["unet"]["compiled_code_ran"] is True
    assert report["unet"]["compile_seconds"] > 0
    assert report["text_encoder"]["effective"] == "NONE"
    messages = [(e.kind, e.message) for e in callbacks.compile_events]
    assert messages[0] == ("progress", "compiling UNet (AOT_EAGER, full)… the first step waits "
                                       "for it")
    assert any(kind == "done" and "UNet compiled in" in m for kind, m in messages)
    engine.close()
    assert unet._compiled_call_impl is None


def test_fallback_through_compile_and_backward_failures(make_one_level_unet, train,
                                                        failing_backends):
    eager = train(make_one_level_unet())
    unet = make_one_level_unet()
    callbacks = RecordingCallbacks()
    engine = CompileEngine(CompileConfig(backend=CompileBackend.TRITON,
                                         dynamic=DynamicShapes.STATIC),
                           {"unet": unet}, callbacks=callbacks, capabilities=GPU,
                           table=failing_table(*failing_backends))
    engine.apply()
    losses = train(unet, engine)
    assert losses == pytest.approx(eager, rel=1e-5, abs=1e-6)  # nothing lost, nothing twice
    report = engine.report()["unet"]
    assert [(f["from"], f["to"]) for f in report["fallbacks"]] == [
        ("TRITON", "INDUCTOR"), ("INDUCTOR", "DEFAULT")]
    assert "refuses to compile" in report["fallbacks"][0]["reason"]
    assert "compiled backward failed" in report["fallbacks"][1]["reason"]
    assert report["effective"] == "DEFAULT" and report["compiled_code_ran"] is True
    assert [e.kind for e in callbacks.compile_events].count("fallback") == 2


def test_regional_lora_checkpointing_backward_fallback_restores_grads(
        make_one_level_unet, train, failing_backends):
    # Regional: blocks nearer the output run their backward (and fill grads) before a failing
    # compiled block raises, so the retry is only equal to eager if those grads were restored.
    eager = train(make_one_level_unet(lora=True, checkpointing=True), accumulation=2)
    unet = make_one_level_unet(lora=True, checkpointing=True)
    keys = list(unet.state_dict())
    engine = CompileEngine(
        CompileConfig(backend=CompileBackend.INDUCTOR, scope=CompileScope.REGIONAL,
                      dynamic=DynamicShapes.STATIC),
        {"unet": unet}, capabilities=GPU, table=failing_table(*failing_backends))
    engine.apply()
    losses = train(unet, engine, accumulation=2)
    assert losses == pytest.approx(eager, rel=1e-5, abs=1e-6)
    assert list(unet.state_dict()) == keys
    blocks = [m for m in unet.modules() if m._compiled_call_impl is not None]
    assert {type(m).__name__ for m in blocks} == {"BasicTransformerBlock", "ResnetBlock2D"}
    report = engine.report()["unet"]
    assert report["scope"] == "REGIONAL" and report["effective"] == "DEFAULT"
    assert report["fallbacks"][0]["from"] == "INDUCTOR"
    assert report["compiled_code_ran"] is True


def test_strict_makes_a_compile_failure_fatal(failing_backends, mlp):
    model = mlp()
    config = CompileConfig(backend=CompileBackend.TRITON, strict=True)
    engine = CompileEngine(config, {"unet": model}, capabilities=GPU,
                           table=failing_table(*failing_backends))
    engine.apply()
    with pytest.raises(CompileError, match=r"UNet \(TRITON\).*refuses to compile"):
        engine.run_guarded(lambda: model(torch.ones(2, 4)).sum().backward())


def test_errors_in_calls_without_a_compile_after_probation_propagate_unchanged(mlp, step):
    model = mlp()
    engine = CompileEngine(aot_eager(), {"unet": model}, capabilities=GPU, probation_steps=1)
    engine.apply()
    engine.run_guarded(step(model))  # compiles
    engine.run_guarded(step(model))  # the quiet call that ends probation
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="user bug"):
        engine.run_guarded(lambda: (_ for _ in ()).throw(ValueError("user bug")))
    assert engine.report()["unet"]["fallbacks"] == []


def test_recompiles_after_warm_up_are_counted_and_warned(mlp, step):
    model = mlp()
    callbacks = RecordingCallbacks()
    engine = CompileEngine(aot_eager(), {"unet": model}, callbacks=callbacks, capabilities=GPU,
                           probation_steps=1, recompile_warning_after=2)
    engine.apply()
    for batch in (2, 3, 5):  # STATIC: every new batch size is a recompile
        engine.run_guarded(step(model, batch))
    report = engine.report()["unet"]
    assert report["recompiles"] >= 2
    assert any("size mismatch" in reason for reason in report["recompile_reasons"])
    kinds = [e.kind for e in callbacks.compile_events]
    assert kinds.count("recompile") >= 2 and "warning" in kinds


class Bypassing(nn.Module):
    """A peer's bug: the block is compiled but its forward is called directly."""

    def __init__(self):
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.block.__class__ = type("BasicTransformerBlock", (nn.Linear,), {})

    def forward(self, x):
        return self.block.forward(x)


def test_compiled_code_that_never_runs_is_detected(step):
    model = Bypassing()
    callbacks = RecordingCallbacks()
    engine = CompileEngine(aot_eager(scope=CompileScope.REGIONAL), {"unet": model},
                           callbacks=callbacks, capabilities=GPU)
    engine.apply()
    assert model.block._compiled_call_impl is not None
    engine.run_guarded(step(model))
    assert engine.report()["unet"]["compiled_code_ran"] is False
    assert any(e.kind == "warning" and "never called" in e.message
               for e in callbacks.compile_events)


def test_three_resolutions_do_not_recompile_after_warm_up(make_one_level_unet, train):
    unet = make_one_level_unet()
    engine = CompileEngine(aot_eager(scope=CompileScope.REGIONAL, dynamic=DynamicShapes.DYNAMIC),
                           {"unet": unet}, capabilities=GPU, probation_steps=1)
    engine.apply()
    train(unet, engine, steps=1, sizes=(8,))
    warm = engine.report()["unet"]["recompiles"]
    train(unet, engine, steps=3, sizes=(16, 12, 8))
    assert engine.report()["unet"]["recompiles"] - warm == 0


def test_explain_reports_graph_breaks_with_source_lines():
    class Breaks(nn.Module):
        def forward(self, x):
            y = x * 2
            if y.sum().item() > 0:  # data-dependent branch: a graph break
                y = y + 1
            return y

    result = explain_component(Breaks(), (torch.ones(3),))
    assert result["graphs"] >= 2 and result["graph_breaks"] >= 1
    assert any("test_engine.py" in where for brk in result["breaks"] for where in brk["where"])
