"""Frozen weights stored in 8 bits (`model.weight_storage=FLOAT8`, issue 46 item 1, and `INT8`,
issue 58 item 1): LoRA trains on the stored tiny model, eager and under REGIONAL AOT_EAGER
compile with no graph break, resumes exactly, never saves an 8-bit weight, is recorded in
run.json, is counted by the memory plan and offered by its refusal, and is refused for a full
fine-tune or without torchao. The quality cost is measured against the same LoRA trained on the
full-precision base (float32, the tiny model's default: bfloat16 is slow on a CPU;
docs/memory.md has the bfloat16 numbers)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import modules.train.memory.memory_check as memory_check
from modules.bench.float8_quality import lora_effect_gap
from modules.config import ConfigError
from modules.config.overrides import apply_overrides
from modules.config.schema import Config, WeightStorage
from modules.config.validate import validate
from modules.events import RecordingCallbacks
from modules.models.loader import load_bundle
from modules.models.tiny import ensure_builtin_model
from modules.models.weight_storage import FORMATS, stored_bytes, stored_weights
from modules.train.memory.levers import STORAGE_LEVERS, DeviceAbility, picked_storage
from modules.train.memory.memory_check import CardMemory
from modules.train.memory.memory_plan import gib, plan_memory
from modules.train.recipe.trainable import component_dtypes, prepare_trainable
from modules.train.trainer import train
from tests.train.lever_runs import lever_runs, make_config
from tests.train.test_resume import assert_resumed_as, run_json

pytest.importorskip("torchao")

FLOAT8 = "model.weight_storage=FLOAT8"
# the compiled run streams every block too (tests/train/test_block_offload_8bit.py)
EVERY_BLOCK = "model.offload_blocks=100"


@pytest.fixture(scope="module")
def full_run(tempera_cache, tmp_path_factory) -> Path:
    """The LoRA on the float32 base the stored runs are measured against (2 steps)."""
    out = tmp_path_factory.mktemp("weight-storage") / "full"
    train(make_config(tempera_cache, out), RecordingCallbacks())
    return out


# W8A8 (int8 matmuls, not torchao's) has its own runs: tests/train/test_w8a8.py
@pytest.fixture(scope="module",
                params=sorted(k for k in FORMATS if WeightStorage(k).torchao))
def runs(request, full_run, tempera_cache, tmp_path_factory) -> tuple[dict[str, Path], dict]:
    """The shared runs of one 8-bit storage (2 steps each on the tiny model,
    tests/train/lever_runs.py): the stored base ("fp8"), stopped at step 1 and resumed, and
    under REGIONAL AOT_EAGER with every block offloaded (it also samples); with that run's graph breaks, beside the
    float32 run ("full"). Over 10 s in all: three short trainings per format, one compiled."""
    storage = f"model.weight_storage={request.param}"
    root = tmp_path_factory.mktemp(f"weight-storage-{request.param.lower()}")
    stored = lever_runs(tempera_cache, root, (storage,), plain=(storage,),
                        compiled=('sampling.prompts=["a red square"]', "sampling.steps=2",
                                  EVERY_BLOCK))
    return {"full": full_run, "fp8": stored.out["plain"], "fp8_resumed": stored.out["resumed"],
            "fp8_compiled": stored.out["compiled"], "storage": request.param}, \
        stored.graph_breaks


def test_stored_run_records_its_storage_and_trains(runs):
    out, _ = runs
    record = run_json(out["fp8"])
    storage = record["weight_storage"]
    assert storage["storage"] == out["storage"] and storage["library"].startswith("torchao ")
    assert storage["format"] == FORMATS[out["storage"]].layout
    assert storage["components"]["unet"]["layers"] > 0
    assert storage["components"]["text_encoder"]["layers"] > 0
    assert "vae" not in storage["components"]
    assert run_json(out["full"])["weight_storage"] == {"storage": "WEIGHT_DTYPE",
                                                        "dtype": "FLOAT32"}
    lines = [line["what"] for line in record["memory_plan"]["lines"]]
    word = FORMATS[out["storage"]].word
    assert any(line.startswith(f"unet linear weights stored as {word}") for line in lines)
    assert all(math.isfinite(loss) for loss in record["losses"]) and len(record["losses"]) == 2


def test_saved_files_hold_no_8_bit_weight(runs):
    out, _ = runs
    files = [p for name in ("fp8", "fp8_resumed") for p in out[name].rglob("*.safetensors")]
    assert any("backup" in str(p) for p in files) and any("final" in str(p) for p in files)
    for path in files:
        with safe_open(str(path), "pt") as f:
            dtypes = {f.get_slice(key).get_dtype() for key in f.keys()}
        assert not any(d.startswith("F8") or d == "I8" for d in dtypes), (path, dtypes)


def test_stored_run_resumes_exactly(runs):
    out, _ = runs
    assert_resumed_as(out["fp8"], out["fp8_resumed"])


def test_stored_weights_compile_regional_aot_eager_without_graph_breaks(runs):
    out, breaks = runs
    report = run_json(out["fp8_compiled"])["compile"]["unet"]
    assert report["effective"] == "AOT_EAGER" and report["scope"] == "REGIONAL", report
    assert report["compiled_code_ran"] and not report["degraded"], report
    assert breaks == {}, breaks
    assert report["late_recompiles"] == 0, report
    assert list((out["fp8_compiled"] / "samples").rglob("*.png"))  # sampling on the stored base
    offload = run_json(out["fp8_compiled"])["block_offload"]  # every block streamed
    assert offload["blocks"] == offload["of"] > 3, offload


def test_quality_cost_against_the_full_precision_base(runs, tempera_cache):
    """The cheap form of docs/memory.md's measurement: the loss curves of the two runs, and each
    saved LoRA applied to the unquantized float32 base, agree closely."""
    out, _ = runs
    full, fp8 = run_json(out["full"])["losses"], run_json(out["fp8"])["losses"]
    assert all(abs(a - b) <= 0.05 * a for a, b in zip(full, fp8)), (full, fp8)
    gap = lora_effect_gap(tempera_cache, torch.float32, out["full"], out["fp8"])
    assert gap["effect_rms"] > 0, gap  # the LoRA changed the prediction
    assert gap["relative_gap"] < 0.5, gap


def test_plan_counts_float8_weights_as_the_real_model_holds_them(tempera_cache, tmp_path):
    """The plan's float8 line (weightless copies) is what the loaded, quantized model holds:
    one byte a value plus a float32 scale per row."""
    config = make_config(tempera_cache, tmp_path / "out", FLOAT8)
    folder = ensure_builtin_model(config.model.path, tempera_cache)
    bundle = load_bundle(folder, config.model, component_dtypes(config))
    prepare_trainable(bundle, config)
    weights = stored_weights(bundle.denoiser)
    assert {type(w).__name__ for w in weights} == {"Float8Tensor"}
    held = sum(w.qdata.numel() * 1 + w.scale.numel() * 4 for w in weights)
    assert weights and held == sum(stored_bytes(w) for w in weights)
    stored = plan_memory(config, folder)
    plan = {what.split(" (")[0]: size for what, size in stored.lines}
    assert plan["unet linear weights stored as float8"] == held
    full = plan_memory(make_config(tempera_cache, tmp_path / "out"), folder)
    assert full.total > stored.total


def test_plan_counts_int8_weights_as_the_real_model_holds_them(tempera_cache, tmp_path):
    """INT8's plan line is what the loaded model holds: one byte a value, a float32 scale and
    an int8 zero point per row; the same bytes as float8 save, for cards without float8."""
    int8 = "model.weight_storage=INT8"
    config = make_config(tempera_cache, tmp_path / "out", int8)
    folder = ensure_builtin_model(config.model.path, tempera_cache)
    bundle = load_bundle(folder, config.model, component_dtypes(config))
    prepare_trainable(bundle, config)
    weights = stored_weights(bundle.denoiser)
    assert weights and {type(w).__name__ for w in weights} == {"Int8Tensor"}
    held = sum(w.qdata.numel() + w.scale.numel() * 4 + w.zero_point.numel() for w in weights)
    assert held == sum(stored_bytes(w) for w in weights)
    stored = plan_memory(config, folder)
    plan = {what.split(" (")[0]: size for what, size in stored.lines}
    assert plan["unet linear weights stored as int8"] == held
    float8 = plan_memory(make_config(tempera_cache, tmp_path / "out", FLOAT8), folder)
    full = plan_memory(make_config(tempera_cache, tmp_path / "out"), folder)
    assert full.total > stored.total
    assert abs(stored.total - float8.total) < 0.02 * float8.total


def test_int8_is_refused_for_a_full_fine_tune_and_greys_nothing_else():
    fine_tune = apply_overrides(Config(), ["model.weight_storage=INT8",
                                           "training.method=FINE_TUNE",
                                           'output.formats=["diffusers"]'])
    [problem] = [p for p in validate(fine_tune) if p.path == "model.weight_storage"]
    assert "never stored in 8 bits (its 256 levels a row" in problem.message
    # with block offload it combines (tests/train/test_block_offload_8bit.py)
    offload = apply_overrides(Config(), ["model.weight_storage=INT8", "model.offload_blocks=2"])
    assert not [p for p in validate(offload) if p.path in ("model.offload_blocks",
                                                            "model.weight_storage")]


@pytest.mark.parametrize("storage", ["INT8", "FLOAT8", "W8A8"])
def test_8_bit_storage_is_refused_for_textual_inversion_not_ignored(storage):
    """A textual inversion stores nothing in 8 bits (train/recipe/trainable.py stores the LoRA
    runs' frozen layers): the setting is refused, naming what does save memory, rather than
    left to do nothing."""
    config = apply_overrides(Config(), [f"model.weight_storage={storage}",
                                        "training.method=TEXTUAL_INVERSION",
                                        "textual_inversion.placeholder=<tok>",
                                        "textual_inversion.initializer=shape"])
    [problem] = [p for p in validate(config) if p.path == "model.weight_storage"]
    assert "WEIGHT_DTYPE with TEXTUAL_INVERSION" in str(problem)
    assert "model.weight_dtype=BFLOAT16" in problem.message
    assert not [p for p in validate(apply_overrides(config, ["model.weight_storage=WEIGHT_DTYPE"]))
                if p.path == "model.weight_storage"]


RTX_3090 = DeviceAbility("RTX 3090 (sm_86)", (8, 6))
RTX_4090 = DeviceAbility("RTX 4090 (sm_89)", (8, 9))


def test_refusal_offers_the_8_bit_storages_this_card_runs(tempera_cache, tmp_path, monkeypatch):
    """Issue 58 item 5: INT8 is offered on every card, FLOAT8 only from sm_89 (Triton converts
    float8 e4m3 from there); each with what it saves and costs, and the one not offered is
    named with why (the refusal on an sm_86 card; on sm_89 the candidates, which plan
    nothing). Over 10 s: the tiny model planned four times, for the refusal."""
    ability = RTX_3090
    config = make_config(tempera_cache, tmp_path / "out")
    folder = ensure_builtin_model(config.model.path, tempera_cache)
    plan = plan_memory(config, folder)
    total, int8 = plan.total, make_config(tempera_cache, tmp_path / "out", "model.weight_storage=INT8")
    saved = total - plan_memory(int8, folder).total
    offered = memory_check.fix_candidates(config, ability)
    assert "model.weight_storage=INT8" in offered and "model.weight_storage=FLOAT8" not in offered
    assert {"model.weight_storage=INT8", "model.weight_storage=FLOAT8"} <= set(
        memory_check.fix_candidates(config, RTX_4090))
    assert picked_storage(RTX_4090) == picked_storage(ability) == WeightStorage.INT8
    assert not {"model.weight_storage=INT8", "model.weight_storage=FLOAT8"} & set(
        memory_check.fix_candidates(make_config(tempera_cache, tmp_path / "out", FLOAT8),
                                    ability))
    # the other candidates are tests/train/test_memory_plan.py's: only these are planned here
    monkeypatch.setattr(memory_check, "fix_candidates", lambda config, ability: [
        o for o in offered if o.startswith("model.weight_storage=")])
    monkeypatch.setattr(memory_check, "card_memory",
                        lambda device: CardMemory("Test GPU 1", 2 ** 20, 2 ** 20))
    monkeypatch.setattr(memory_check, "device_ability", lambda device: ability)
    with pytest.raises(ConfigError) as caught:
        memory_check.check_memory(config, folder, torch.device("cpu"))
    message = str(caught.value)
    assert (f"--set model.weight_storage=INT8 saves {gib(saved)} (then {gib(total - saved)}; "
            "costs: quality: a 2.3 % gap") in message
    float8 = "--set model.weight_storage=FLOAT8 saves"
    refused = ("Not offered: --set model.weight_storage=FLOAT8, as RTX 3090 (sm_86) is older "
               "than sm_89: inductor's GPU code (Triton) cannot convert float8 e4m3")
    assert float8 not in message and refused in message
    # --check's line for it (lever_line prints "not for this run: " and this)
    assert STORAGE_LEVERS[WeightStorage.FLOAT8].state_on(config, ability).not_for.startswith(
        "not on this device: RTX 3090 (sm_86) is older than sm_89")


def test_float8_on_a_card_without_float8_is_a_warning(tempera_cache, tmp_path, monkeypatch):
    config = make_config(tempera_cache, tmp_path / "out", FLOAT8)
    folder = ensure_builtin_model(config.model.path, tempera_cache)
    monkeypatch.setattr(memory_check, "device_ability", lambda device: RTX_3090)
    [warning] = memory_check.check_memory(config, folder, torch.device("cpu")).warnings
    assert warning.startswith("frozen linear weights stored as float8 is on, and RTX 3090 "
                              "(sm_86) is older than sm_89")
    monkeypatch.setattr(memory_check, "device_ability", lambda device: RTX_4090)
    assert not memory_check.check_memory(config, folder, torch.device("cpu")).warnings


def test_float8_is_refused_for_a_full_fine_tune_and_without_torchao(monkeypatch):
    fine_tune = apply_overrides(Config(), [FLOAT8, "training.method=FINE_TUNE",
                                           'output.formats=["diffusers"]'])
    problems = [p for p in validate(fine_tune) if p.path == "model.weight_storage"]
    assert problems and "never stored in 8 bits (its 3-bit mantissa" in problems[0].message

    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    problems = [p for p in validate(apply_overrides(Config(), [FLOAT8]))
                if p.path == "model.weight_storage"]
    assert problems and "pip install torchao" in problems[0].message


def test_float8_field_is_greyed_for_a_full_fine_tune_while_off():
    from modules.config.field_rules import unused_fields

    fine_tune = apply_overrides(Config(), ["training.method=FINE_TUNE"])
    assert "model.weight_storage" in unused_fields(fine_tune)
    assert "model.weight_storage" not in unused_fields(Config())
    # when on, validation asks to turn it off, so it stays editable
    on = apply_overrides(Config(), ["training.method=FINE_TUNE", FLOAT8])
    assert "model.weight_storage" not in unused_fields(on)


def test_check_compilation_traces_the_float8_layers_without_breaks(tempera_cache, tmp_path):
    """*Check compilation* stores the weights as training does, and finds no graph break in
    the denoiser's blocks or the text encoder with float8 layers."""
    from modules.train.setup.explain_run import explain_config

    config = make_config(tempera_cache, tmp_path / "out", FLOAT8, "compile.backend=AOT_EAGER",
                         "compile.scope=REGIONAL", "compile.text_encoder=true")
    result = explain_config(config)
    assert set(result) == {"unet", "text_encoder"}
    for name, report in result.items():
        assert report["regions"], name
        assert all(r["graph_breaks"] == 0 for r in report["regions"]), (name, report["regions"])


def test_float8_is_refused_when_several_processes_train(tempera_cache, tmp_path, monkeypatch):
    import modules.train.setup.prepare as prepare
    from modules.train.setup.prepare import check_run

    monkeypatch.setattr(prepare, "launched_distributed", lambda: True)
    with pytest.raises(ConfigError) as caught:
        check_run(make_config(tempera_cache, tmp_path / "out", FLOAT8), RecordingCallbacks())
    [problem] = caught.value.problems
    assert problem.path == "model.weight_storage" and "DistributedDataParallel" in str(problem)
    assert not (tmp_path / "out").exists()  # nothing written
