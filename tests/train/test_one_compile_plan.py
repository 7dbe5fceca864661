"""Check compilation and training ask one plan: the same backend, options and CUDA-graph decision.

The machine is faked (a CUDA machine on which every backend runs), as a GPU is rarely lent: the
question is whether the two front ends decide alike, not whether the GPU runs the result.
"""
from __future__ import annotations

import pytest

from modules.compile import Capabilities
from modules.config.schema import CompileBackend, CompileMode, CompileScope
from modules.events import NullCallbacks

CUDA = Capabilities.everything("cuda")
CASES = [(backend, mode) for backend, mode in (
    (CompileBackend.TRITON, CompileMode.DEFAULT),
    (CompileBackend.DEFAULT, CompileMode.REDUCE_OVERHEAD),  # the mode asks for CUDA graphs
    (CompileBackend.AOT_EAGER, CompileMode.DEFAULT))]
_BUNDLES: dict[str, object] = {}


def plan_facts(entry: dict) -> dict:
    return {key: entry[key] for key in ("requested", "effective", "cudagraphs",
                                        "torch_compile_kwargs")}


def checked_and_trained(config, monkeypatch, caps: Capabilities) -> tuple[dict, dict]:
    """(what Check compilation says per component, what the training engine applies)."""
    import modules.compile.explain as explain_module
    import modules.train.recipe.compile_guard as compile_guard
    import modules.train.setup.explain_run as explain_run
    from modules.models.loader import resolve_model_path
    from modules.paths import cache_dir_for
    from modules.models.loader import load_bundle
    from modules.train.recipe.trainable import component_dtypes, trained_components

    monkeypatch.setattr(explain_run, "detect_capabilities", lambda device: caps)
    monkeypatch.setattr(compile_guard, "detect_capabilities", lambda device: caps)
    # graph breaks are not the question here: skip dynamo's explain run (seconds per region)
    monkeypatch.setattr(explain_module, "explain_component",
                        lambda module, example, kwargs=None: {"graphs": 1, "graph_breaks": 0,
                                                              "ops": 0, "breaks": []})
    checked = explain_run.explain_config(config)
    path = resolve_model_path(config.model.path, cache_dir_for(config.general.cache_dir))
    bundle = _BUNDLES.get(str(path)) or _BUNDLES.setdefault(str(path), load_bundle(path, config.model, component_dtypes(config)))
    engine = compile_guard.build_compile_guard(config, bundle, "cpu", {},
                                               trained_components(config), NullCallbacks())
    try:
        trained = engine.report()
    finally:
        engine.close()
    return checked, trained


def test_a_checkpointed_regional_triton_run_on_cuda_is_checked_with_cuda_graphs_off(
        tiny_config, monkeypatch):
    # The case where Check compilation once said "CUDA graphs on" and training turned them off.
    config = tiny_config("compile.backend=TRITON", "compile.scope=REGIONAL", "compile.unet=true",
                         "training.gradient_checkpointing=true")
    checked, trained = checked_and_trained(config, monkeypatch, CUDA)
    assert checked["unet"]["effective"] == trained["unet"]["effective"] == "TRITON"
    assert checked["unet"]["cudagraphs"] is trained["unet"]["cudagraphs"] is False
    assert "154306" in checked["unet"]["degraded"] and "154306" in trained["unet"]["degraded"]
    from modules.compile import format_explanation
    assert "CUDA graphs on" not in format_explanation(checked)


@pytest.mark.parametrize("scope", list(CompileScope))
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("backend, mode", CASES, ids=lambda v: getattr(v, "value", v))
def test_check_compilation_and_training_agree(tiny_config, monkeypatch, backend, mode,
                                              checkpointing, scope):
    config = tiny_config(f"compile.backend={backend.value}", f"compile.mode={mode.value}",
                         f"compile.scope={scope.value}", "compile.unet=true",
                         "compile.text_encoder=true",
                         f"training.gradient_checkpointing={str(checkpointing).lower()}")
    checked, trained = checked_and_trained(config, monkeypatch, CUDA)
    assert set(checked) == {"unet", "text_encoder"}
    for name, entry in checked.items():
        assert plan_facts(entry) == plan_facts(trained[name]), name
        assert (entry["degraded"] or "") in (trained[name]["degraded"] or "")


def test_they_agree_on_this_machine_too(tiny_config, monkeypatch):
    from modules.compile import detect_capabilities

    config = tiny_config("compile.backend=TRITON", "compile.unet=true")
    checked, trained = checked_and_trained(config, monkeypatch, detect_capabilities("cpu"))
    assert plan_facts(checked["unet"]) == plan_facts(trained["unet"])
    assert checked["unet"]["effective"] != "TRITON"  # no CUDA here: TRITON cannot run
