"""The backend table as handed to torch.compile, mode merging, capability degrade, selection."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from modules.compile import (BACKENDS, Capabilities, CompileEngine, CompileFacts,
                             ComponentTraining, build_plan, check_table, detect_capabilities)
from modules.compile.backends import BackendRow
from modules.compile.plan import RECOMPILE_LIMIT
from modules.config.schema import (CompileBackend, CompileConfig, CompileMode, CompileScope,
                                   DynamicShapes)
from modules.events import RecordingCallbacks

# The product design's table, written out literally (docs/compilation.md). Dynamic shapes
# default to torch's automatic ones (dynamic=None, compile.dynamic AUTO): measured faster to
# compile than dynamic=True, which also crashes full-UNet inductor (docs/compilation.md).
SEED_KWARGS = {
    CompileBackend.DEFAULT: {"fullgraph": False, "dynamic": None},
    CompileBackend.INDUCTOR: {"backend": "inductor", "fullgraph": False, "dynamic": None,
                              "options": {"max_autotune": True, "epilogue_fusion": True,
                                          "triton.cudagraphs": False}},
    CompileBackend.TRITON: {"backend": "inductor", "fullgraph": False, "dynamic": None,
                            "options": {"triton.cudagraphs": True, "shape_padding": True,
                                        "max_autotune": True, "epilogue_fusion": True}},
    CompileBackend.AOT_EAGER: {"backend": "aot_eager", "fullgraph": False, "dynamic": None},
}
GPU = Capabilities.everything("cuda")
CPU = Capabilities("cpu", False, None, False, "no triton", "/usr/bin/g++")
# Every compiled plan raises dynamo's recompile limit (plan.RECOMPILE_LIMIT): per call where
# this torch has the argument (>= 2.12), else process-wide (tested below with OLD_TORCH).
LIMIT = {"recompile_limit": RECOMPILE_LIMIT} if GPU.per_call_recompile_limit else {}
NEW_TORCH = Capabilities("cuda", True, (9, 0), True, None, None,
                         GPU.compile_keywords | {"recompile_limit"})


def plan_of(config: CompileConfig, component: str, caps: Capabilities,
            training: ComponentTraining | None = None):
    """`build_plan`'s plan for ``component``, trained as ``training`` says (default: frozen)."""
    facts = CompileFacts(caps, {component: training} if training else {})
    return build_plan(config, facts)[component]


class Recorder:
    """Stands in for torch.compile: records the kwargs, returns the function unchanged."""

    def __init__(self):
        self.calls: list[tuple[object, dict]] = []

    def __call__(self, fn, **kwargs):
        self.calls.append((getattr(fn, "__self__", fn), kwargs))
        if kwargs.get("options") is not None and kwargs.get("mode") is not None:
            raise AssertionError("mode and options passed together")
        return fn


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(torch, "compile", rec)
    return rec


def components():
    return {"unet": nn.Linear(2, 2), "text_encoder": [nn.Linear(2, 2), nn.Linear(2, 2)],
            "vae": nn.Sequential()}


@pytest.mark.parametrize("backend", list(CompileBackend))
def test_kwargs_handed_to_torch_compile_are_the_seed_table(recorder, backend):
    unet = nn.Linear(2, 2)
    engine = CompileEngine(CompileConfig(backend=backend, scope=CompileScope.FULL), {"unet": unet}, capabilities=GPU)
    engine.apply()
    if backend == CompileBackend.NONE:
        assert recorder.calls == []
        assert unet._compiled_call_impl is None
    else:
        assert recorder.calls == [(unet, {**SEED_KWARGS[backend], **LIMIT})]
        assert engine.report()["unet"]["torch_compile_kwargs"] == {**SEED_KWARGS[backend], **LIMIT}
    engine.close()
    assert unet._compiled_call_impl is None


@pytest.mark.parametrize("dynamic, flag", [(DynamicShapes.DYNAMIC, True),
                                           (DynamicShapes.AUTO, None),
                                           (DynamicShapes.STATIC, False)])
def test_dynamic_and_fullgraph_follow_the_config(recorder, dynamic, flag):
    config = CompileConfig(backend=CompileBackend.AOT_EAGER, dynamic=dynamic, fullgraph=True,
                           scope=CompileScope.FULL)
    CompileEngine(config, {"unet": nn.Linear(2, 2)}, capabilities=GPU).apply()
    assert recorder.calls[0][1] == {"backend": "aot_eager", "fullgraph": True, "dynamic": flag,
                                    **LIMIT}


def test_every_table_option_exists_in_this_torch():
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    keys = [key for row in BACKENDS.values() if row for key in row.options]
    assert keys and all(key in known for key in keys)
    check_table()


def test_unknown_option_is_a_clear_error():
    table = {**BACKENDS, CompileBackend.INDUCTOR: BackendRow("inductor", True, {"no_such": 1})}
    with pytest.raises(ValueError, match="INDUCTOR: inductor option 'no_such'"):
        CompileEngine(CompileConfig(backend=CompileBackend.INDUCTOR), {}, capabilities=GPU,
                      table=table)


@pytest.mark.parametrize("mode", list(CompileMode))
@pytest.mark.parametrize("backend", [b for b in CompileBackend if b != CompileBackend.NONE])
def test_mode_is_merged_into_options_never_passed(mode, backend):
    plan = plan_of(CompileConfig(backend=backend, mode=mode), "unet", GPU)
    assert "mode" not in plan.torch_compile_kwargs
    fn = torch.compile(lambda x: x, **plan.torch_compile_kwargs)  # torch refuses mode+options
    assert callable(fn)
    if BACKENDS[backend].inductor:
        from torch._inductor import list_mode_options

        from modules.compile.backends import MODE_NAMES
        expected = {**list_mode_options(MODE_NAMES[mode]), **BACKENDS[backend].options}
        assert plan.inductor_options == expected
    else:
        assert plan.inductor_options == {} and "options" not in plan.torch_compile_kwargs
        assert bool(plan.notes) == (mode != CompileMode.DEFAULT)


def test_backend_row_wins_over_mode():
    plan = plan_of(CompileConfig(backend=CompileBackend.INDUCTOR,
                                 mode=CompileMode.MAX_AUTOTUNE), "unet", GPU)
    assert plan.inductor_options["triton.cudagraphs"] is False  # the mode would turn it on
    assert plan.inductor_options["coordinate_descent_tuning"] is True  # added by the mode


def test_cudagraph_mode_on_cpu_is_turned_off_and_reported():
    plan = plan_of(CompileConfig(backend=CompileBackend.DEFAULT,
                                 mode=CompileMode.REDUCE_OVERHEAD), "unet", CPU)
    assert plan.inductor_options["triton.cudagraphs"] is False
    assert "CUDA graphs" in plan.degraded


def test_triton_degrades_on_this_cpu_with_a_reason(recorder):
    caps = detect_capabilities("cpu")
    callbacks = RecordingCallbacks()
    engine = CompileEngine(CompileConfig(backend=CompileBackend.TRITON), {"unet": nn.Linear(2, 2)},
                           callbacks=callbacks, capabilities=caps)
    engine.apply()
    report = engine.report()["unet"]
    assert report["requested"] == "TRITON"
    assert report["effective"] == ("INDUCTOR" if caps.cpp_compiler else "AOT_EAGER")
    assert "CUDA GPU" in report["degraded"]
    assert "triton.cudagraphs" not in recorder.calls[0][1].get("options", {}) or \
        recorder.calls[0][1]["options"]["triton.cudagraphs"] is False
    degraded = [e for e in callbacks.compile_events if e.kind == "degraded"]
    assert degraded and "TRITON" in degraded[0].message


@pytest.mark.parametrize("caps, backend, effective, words", [
    (Capabilities("cuda", True, (6, 1), False, "compute capability 6.1 is below 7.0", None),
     CompileBackend.TRITON, CompileBackend.AOT_EAGER, "6.1"),
    (Capabilities("cuda", True, (6, 1), False, "compute capability 6.1 is below 7.0", None),
     CompileBackend.INDUCTOR, CompileBackend.AOT_EAGER, "6.1"),
    (Capabilities("cpu", False, None, False, "no triton", None),
     CompileBackend.DEFAULT, CompileBackend.AOT_EAGER, "C++ compiler"),
    (CPU, CompileBackend.AOT_EAGER, CompileBackend.AOT_EAGER, None),
])
def test_capability_degrade(caps, backend, effective, words):
    plan = plan_of(CompileConfig(backend=backend), "unet", caps)
    assert plan.effective == effective
    assert (plan.degraded is None) if words is None else (words in plan.degraded)


def test_only_selected_components_are_compiled(recorder):
    parts = components()
    config = CompileConfig(backend=CompileBackend.AOT_EAGER, denoiser=False, text_encoder=True,
                           vae=False)
    engine = CompileEngine(config, parts, capabilities=GPU)
    engine.apply()
    compiled = [module for module, _ in recorder.calls]
    assert compiled == parts["text_encoder"]  # both text encoders, nothing else
    report = engine.report()
    assert [report[n]["effective"] for n in ("unet", "text_encoder", "vae")] == \
        ["NONE", "AOT_EAGER", "NONE"]
    assert report["unet"]["requested"] == "NONE"


def test_vae_full_compiles_encoder_and_decoder(recorder):
    vae = nn.Module()
    vae.encoder, vae.decoder, vae.quant_conv = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    config = CompileConfig(backend=CompileBackend.AOT_EAGER, denoiser=False, vae=True)
    CompileEngine(config, {"vae": vae}, capabilities=GPU).apply()
    assert [module for module, _ in recorder.calls] == [vae.encoder, vae.decoder]


@pytest.mark.parametrize("scope", list(CompileScope))
def test_both_scopes_add_only_a_recompile_limit(scope):
    plan = plan_of(CompileConfig(backend=CompileBackend.AOT_EAGER, scope=scope), "unet",
                   NEW_TORCH)
    extra = {k: v for k, v in plan.torch_compile_kwargs.items()
             if k not in SEED_KWARGS[CompileBackend.AOT_EAGER]}
    assert extra == {"recompile_limit": RECOMPILE_LIMIT} and RECOMPILE_LIMIT > 8
    assert plan.process_recompile_limit is None


def test_report_has_the_stable_keys():
    engine = CompileEngine(CompileConfig(backend=CompileBackend.NONE), {}, capabilities=GPU)
    engine.apply()
    report = engine.report()
    assert set(report) == {"unet", "text_encoder", "vae"}
    assert set(report["unet"]) == {
        "requested", "effective", "scope", "torch_compile_kwargs", "inductor_options",
        "cudagraphs", "persistent_grads", "recompile_limit", "notes", "fallbacks", "degraded",
        "compile_seconds", "compiles", "recompiles", "late_recompiles", "recompile_reasons", "cache",
        "cache_hits", "cache_misses", "bundle", "compiled_code_ran"}
    assert report["unet"]["cache"] == "off" and report["unet"]["compiled_code_ran"] is False
    assert report["unet"]["bundle"] == "off"  # nothing compiles with inductor


# -- torch without a per-call recompile_limit (the GPU image's torch 2.11) --------------------
OLD_TORCH = Capabilities("cuda", True, (9, 0), True, None, None,
                         frozenset({"model", "fullgraph", "dynamic", "backend", "mode",
                                    "options", "disable"}))


def test_without_a_per_call_limit_the_process_limit_is_raised_and_restored(recorder):
    import torch._dynamo

    before = torch._dynamo.config.recompile_limit
    unet = nn.Linear(2, 2)
    engine = CompileEngine(CompileConfig(backend=CompileBackend.AOT_EAGER), {"unet": unet},
                           capabilities=OLD_TORCH)
    engine.apply()
    assert "recompile_limit" not in recorder.calls[0][1]
    assert torch._dynamo.config.recompile_limit == RECOMPILE_LIMIT
    report = engine.report()["unet"]
    assert report["recompile_limit"] == {"value": RECOMPILE_LIMIT, "where": "process"}
    engine.close()
    assert torch._dynamo.config.recompile_limit == before


def test_the_installed_torch_accepts_every_planned_keyword():
    caps = detect_capabilities("cpu")
    for backend in CompileBackend:
        plan = plan_of(CompileConfig(backend=backend), "unet", caps)
        assert set(plan.torch_compile_kwargs) <= caps.compile_keywords


# -- CUDA graphs against the training settings -----------------------------------------------
def _trained(checkpointing: bool, accumulation: int = 1):
    from modules.compile import ComponentTraining
    return ComponentTraining(trained=True, gradient_checkpointing=checkpointing,
                             accumulation=accumulation)


@pytest.mark.parametrize("scope", list(CompileScope))
def test_cudagraphs_with_checkpointing_are_off_for_regional_blocks_only(scope):
    plan = plan_of(CompileConfig(backend=CompileBackend.TRITON, scope=scope), "unet", GPU,
                   training=_trained(checkpointing=True))
    if scope == CompileScope.REGIONAL:
        assert plan.cudagraphs is False and "154306" in plan.degraded
    else:
        assert plan.cudagraphs is True and plan.degraded is None


def test_cudagraphs_on_a_trained_component_keep_gradients_allocated():
    trained = plan_of(CompileConfig(backend=CompileBackend.TRITON), "unet", GPU,
                      training=_trained(checkpointing=False, accumulation=4))
    frozen = plan_of(CompileConfig(backend=CompileBackend.TRITON, text_encoder=True),
                     "text_encoder", GPU)
    assert trained.cudagraphs and trained.persistent_grads
    assert any("169545" in note for note in trained.notes)
    assert frozen.cudagraphs and not frozen.persistent_grads


def test_a_mode_that_adds_cudagraphs_follows_the_same_rules():
    plan = plan_of(CompileConfig(backend=CompileBackend.DEFAULT,
                                 mode=CompileMode.REDUCE_OVERHEAD,
                                 scope=CompileScope.REGIONAL), "unet", GPU,
                   training=_trained(checkpointing=True))
    assert plan.cudagraphs is False and "154306" in plan.degraded


PRESETS = sorted((Path(__file__).resolve().parents[2] / "training_presets").rglob("*.json"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: str(p.relative_to(p.parents[1])))
@pytest.mark.parametrize("backend, mode", [(CompileBackend.TRITON, CompileMode.DEFAULT),
                                           (CompileBackend.DEFAULT, CompileMode.REDUCE_OVERHEAD),
                                           (CompileBackend.INDUCTOR, CompileMode.MAX_AUTOTUNE)])
def test_every_preset_gets_a_safe_cudagraph_plan_on_a_gpu(preset, backend, mode):
    from modules.config import load_config
    from modules.train.recipe.compile_guard import component_training
    from modules.train.recipe.trainable import trained_components

    config = load_config(preset)
    config.compile.backend, config.compile.mode = backend, mode
    training = component_training(config, trained_components(config))
    for name in ("unet", "text_encoder", "vae"):
        plan = plan_of(config.compile, name, GPU, training=training[name])
        how = training[name]
        if plan.cudagraphs:
            assert not (how.gradient_checkpointing and plan.scope == CompileScope.REGIONAL)
            assert plan.persistent_grads == how.trained
        if backend == CompileBackend.INDUCTOR:
            assert not plan.cudagraphs  # INDUCTOR promises no CUDA graphs, whatever the mode


# -- sizes the compiler cannot take symbolic --------------------------------------------------
@pytest.mark.parametrize("backend", [CompileBackend.INDUCTOR, CompileBackend.DEFAULT])
def test_full_inductor_keeps_unet_height_and_width_static(backend):
    from modules.compile.dynamic_dims import input_dims

    full = plan_of(CompileConfig(backend=backend, scope=CompileScope.FULL,
                                 dynamic=DynamicShapes.DYNAMIC), "unet", GPU)
    assert full.static_spatial and full.torch_compile_kwargs["dynamic"] is None
    assert "AUTO with static height and width" in full.degraded
    assert input_dims(full, DynamicShapes.AUTO) == ((0,), (2, 3))
    regional = plan_of(CompileConfig(backend=backend, scope=CompileScope.REGIONAL),
                       "unet", GPU)
    assert regional.static_spatial is None
    assert input_dims(regional, DynamicShapes.AUTO) == ((0, 2, 3), ())
    eager_kernels = plan_of(CompileConfig(backend=CompileBackend.AOT_EAGER,
                                          scope=CompileScope.FULL,
                                          dynamic=DynamicShapes.DYNAMIC), "unet", GPU)
    assert eager_kernels.static_spatial is None and eager_kernels.degraded is None


def test_the_default_dynamic_shapes_are_auto():
    assert CompileConfig().dynamic == DynamicShapes.AUTO
