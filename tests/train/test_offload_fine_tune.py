"""Block offload for a full fine-tune (issue 58 item 3, train/memory/offload_trained.py) on the
CPU: the offloaded blocks' trained weights live on the host and step there, inside the fused
backward pass; training with it equals the same fine-tune without offload bit for bit (the
CPU's "transfer" is a copy), resumes exactly from a backup (the host weights' optimizer state
saved and restored), compiles REGIONAL AOT_EAGER with no graph break and no recompile, and is
recorded in run.json and the memory plan; refused without the fused pass. What only a GPU
shows (the host step's time, the device memory saved) is not measured here."""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from modules.config import ConfigError
from modules.config.validate import validate
from modules.events import RecordingCallbacks
from modules.train.memory.offload_trained import HostSteps
from modules.train.trainer import train
from tests.train.lever_runs import (REGIONAL_AOT_EAGER, LeverRuns, make_config,
                                    train_counting_dynamo)
from tests.train.test_resume import assert_resumed_as, run_json, stop_then_resume

# with an EMA: its copy of an offloaded weight lives (and steps) on the host too
FINE_TUNE = ("training.method=FINE_TUNE", "training.fused_backward=true",
             "training.learning_rate=1e-4", "training.ema=true")
OFFLOAD = "model.offload_blocks=3"


@dataclass
class FineTuneRuns(LeverRuns):
    """The lever's runs and, per offloaded run, how many weights stepped on the host."""
    host_steps: dict[str, int]


@pytest.fixture(scope="module")
def runs(tempera_cache, tmp_path_factory) -> FineTuneRuns:
    """2 fused fine-tune steps on the tiny SD 1.5 model, AdamW and an EMA
    (tests/train/lever_runs.py's runs): "plain" without offload; 3 blocks offloaded, stopped at
    step 1 and resumed from its backup; the same under REGIONAL AOT_EAGER with gradient
    checkpointing (its re-run forwards happen in backward, the blocks resident), sampling
    after each step (a pass streamed on its own). Over 10 s: four short fine-tunes (the stop
    and the resume are two), one compiled."""
    counted = {"resumed": 0, "compiled": 0}
    current = ["resumed"]
    real_step = HostSteps.step

    def step(self, param, optimizer):
        counted[current[0]] += 1
        real_step(self, param, optimizer)

    root = tmp_path_factory.mktemp("offload-fine-tune")
    out = {name: root / name for name in ("plain", "resumed", "compiled")}
    train(make_config(tempera_cache, out["plain"], *FINE_TUNE), RecordingCallbacks())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HostSteps, "step", step)
        stop_then_resume(make_config(tempera_cache, out["resumed"], *FINE_TUNE, OFFLOAD), at=1)
        current[0] = "compiled"
        breaks, recompiles = train_counting_dynamo(make_config(
            tempera_cache, out["compiled"], *FINE_TUNE, OFFLOAD, *REGIONAL_AOT_EAGER,
            "training.gradient_checkpointing=true", 'sampling.prompts=["a red circle"]',
            "sampling.every_steps=1", "sampling.steps=2"))
    return FineTuneRuns(out, breaks, recompiles, counted)


def test_offloaded_fine_tune_resumes_to_the_fine_tune_without(runs):
    """Stopped after step 1 and resumed from its backup, the offloaded fine-tune equals the
    unbroken one without offload bit for bit: the losses step by step and every saved weight
    (the offloaded blocks' too: their host copies stepped and were fetched again); a backup
    that lost the host weights' optimizer state would resume to other weights."""
    assert_resumed_as(runs.out["plain"], runs.out["resumed"])


def test_the_offloaded_weights_step_on_the_host(runs):
    """Every trained weight of the offloaded blocks stepped through the host step, once per
    optimizer step (2 steps in each run), and run.json says so."""
    record = run_json(runs.out["resumed"])["block_offload"]
    assert record["blocks"] == 3 and record["of"] > 3 and record["trained_weights"] is True
    assert record["host_optimizer"] is True and record["host_weights"] > 0
    assert record["offloaded_bytes"] > record["in_flight_bytes"] > 0
    assert runs.host_steps == {"resumed": 2 * record["host_weights"],
                               "compiled": 2 * record["host_weights"]}
    assert run_json(runs.out["plain"])["block_offload"] == {"blocks": 0}


def test_offloaded_fine_tune_compiles_regional_without_breaks_or_recompiles(runs):
    report = run_json(runs.out["compiled"])["compile"]["unet"]
    assert report["effective"] == "AOT_EAGER" and report["scope"] == "REGIONAL", report
    assert report["compiled_code_ran"] and not report["degraded"], report
    assert runs.graph_breaks == {} and runs.recompiles == {}, (runs.graph_breaks,
                                                               runs.recompiles)
    # dynamo (torch 2.13) no longer counts recompiles in counters["recompiles"]: the compile
    # engine's own count is the check that can fail (none after the first step)
    assert report["late_recompiles"] == 0, report
    assert run_json(runs.out["compiled"])["losses"] == pytest.approx(
        run_json(runs.out["plain"])["losses"], rel=1e-4)
    assert len(list((runs.out["compiled"] / "samples").rglob("*.png"))) == 2


# ------------------------------------------------------------------ refused
REFUSED = {  # the settings beside FINE_TUNE and offload, the field refused and what it says
    "without the fused pass": (("training.fused_backward=false",), "model.offload_blocks",
                               "set training.fused_backward=true"),
    "gradient accumulation": (("training.gradient_accumulation=2",), "training.fused_backward",
                              "training.gradient_accumulation=1"),
    "FULL compile": (("compile.denoiser=true", "compile.scope=FULL"), "model.offload_blocks",
                     "use compile.scope=REGIONAL"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_offloaded_fine_tune_is_refused_where_it_cannot_work(tempera_cache, tmp_path, case):
    """Refused before anything is loaded or written: validation names the field and the fix,
    and training raises before its output folder exists."""
    settings, field, fix = REFUSED[case]
    config = make_config(tempera_cache, tmp_path / "out", *FINE_TUNE, OFFLOAD, *settings)
    found = [p for p in validate(config) if p.path == field]
    assert len(found) == 1 and fix in found[0].message, found
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        train(config, RecordingCallbacks())
    assert not (tmp_path / "out").exists()


def test_the_field_is_open_to_a_fused_fine_tune_only(tempera_cache, tmp_path):
    from modules.config.field_rules import unused_fields

    fused = make_config(tempera_cache, tmp_path, *FINE_TUNE)
    plain = make_config(tempera_cache, tmp_path, "training.method=FINE_TUNE")
    assert "model.offload_blocks" not in unused_fields(fused)
    assert "model.offload_blocks" in unused_fields(plain)


# ------------------------------------------------------------------ the mechanism, observed
@pytest.fixture(scope="module")
def fine_tune_unet(tempera_cache, tmp_path_factory):
    """The tiny SD 1.5 model loaded and made trainable for a full fine-tune, its config and
    folder."""
    from modules.models.loader import load_bundle
    from modules.models.tiny import ensure_builtin_model
    from modules.train.recipe.trainable import component_dtypes, prepare_trainable

    config = make_config(tempera_cache, tmp_path_factory.mktemp("ft-unet"), *FINE_TUNE, OFFLOAD)
    folder = ensure_builtin_model(config.model.path, tempera_cache)
    bundle = load_bundle(folder, config.model, component_dtypes(config))
    prepare_trainable(bundle, config)
    return config, folder, bundle


def trained_streamer(bundle, count: int):
    from modules.models.families import family_of
    from modules.train.memory.offload import build_streamer, offload_choice

    names = family_of(bundle.model_type).repeated_blocks
    streamer = build_streamer(offload_choice(bundle.denoiser, names, count, trained=True),
                              torch.device("cpu"))
    assert streamer is not None and streamer.trained
    return streamer


def test_a_host_step_runs_on_the_master_and_drops_the_device_copy(fine_tune_unet, monkeypatch):
    """One forward and backward of the tiny UNet with 3 blocks offloaded, their weights
    trained: each offloaded weight ran on a resident copy, its hook stepped the host master
    (its values changed in place, its optimizer state made beside it) and left the weight
    pointing at the master at once (the device copy dropped then, not at eviction); the
    weights outside the blocks stepped as usual, on their own storage."""
    from modules.train.recipe.fused import FusedBackward

    _, _, bundle = fine_tune_unet
    unet = bundle.denoiser
    streamer = trained_streamer(bundle, 3)
    trained = [p for p in unet.parameters() if p.requires_grad]
    optimizer = FusedBackward([{"params": trained, "lr": 1e-3}],
                              lambda group: torch.optim.AdamW([group]), max_grad_norm=1.0)
    optimizer.host_steps = HostSteps(streamer)
    masters = {id(p): host for i in streamer.offloaded for p, host in streamer.held(i)}
    before = {key: host.clone() for key, host in masters.items()}
    seen: dict[int, tuple[int, int]] = {}  # the weight's storage before and after its step
    real_step = HostSteps.step

    def step(self, param, inner):
        ptr = param.data_ptr()
        real_step(self, param, inner)
        seen[id(param)] = (ptr, param.data_ptr())
    monkeypatch.setattr(HostSteps, "step", step)
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, unet.config.in_channels, 8, 8, generator=generator),
              torch.tensor([10, 500]),
              torch.randn(2, 4, unet.config.cross_attention_dim, generator=generator))
    outside = next(p for p in trained if id(p) not in masters)
    outside_ptr, outside_before = outside.data_ptr(), outside.detach().clone()
    try:
        streamer.begin()
        unet(*inputs).sample.square().mean().backward()
        streamer.end()
    finally:
        optimizer.close()
        streamer.close()
    assert seen.keys() == masters.keys() and optimizer.host_steps.stepped == len(masters)
    for key, (during, after) in seen.items():
        assert during != masters[key].data_ptr() and after == masters[key].data_ptr()
        assert not torch.equal(masters[key], before[key])
    inner = {id(w.param_groups[0]["params"][0]): w for w, _ in optimizer.weights}
    for key in masters:
        state = inner[key].state[inner[key].param_groups[0]["params"][0]]
        assert state["exp_avg"].shape == masters[key].shape
    assert outside.data_ptr() == outside_ptr and not torch.equal(outside, outside_before)


# ------------------------------------------------------------------ the memory plans
def test_plans_move_the_offloaded_weights_and_their_optimizer_state(fine_tune_unet, tempera_cache,
                                                                     tmp_path):
    """The memory plan's offload line (weightless copies) is what the real streamer holds on
    the host for the blocks it picks: their weights, AdamW's two float32 copies of each and
    the EMA's copy, less the two blocks in flight; the RAM plan's training phase holds the
    same; the refusal offers offload to a fused fine-tune, with the fused pass to a plain one,
    to neither where the fused pass cannot combine."""
    from modules.train.memory import memory_check
    from modules.train.memory.memory_plan import plan_memory
    from modules.train.memory.ram_plan import plan_ram

    config, folder, bundle = fine_tune_unet
    streamer = trained_streamer(bundle, 3)
    try:
        held = [sum(t.numel() * t.element_size() for t in streamer.host_tensors(i))
                for i in streamer.offloaded]
        blocks = len(streamer.blocks)
        assert all(p.requires_grad for i in streamer.offloaded for p, _ in streamer.held(i))
    finally:
        streamer.close()
    plan = plan_memory(config, folder)
    [(what, size)] = [line for line in plan.lines if "blocks offloaded" in line[0]]
    assert all(word in what for word in ("trained weights included", "optimizer state",
                                         "EMA copy"))
    in_flight = sum(sorted(held)[-2:])
    assert size == in_flight - 4 * sum(held) < 0
    without = plan_memory(make_config(tempera_cache, tmp_path, *FINE_TUNE), folder)
    assert without.total - plan.total == -size
    training = plan_ram(config, folder, torch.device("cuda")).phases[-1]
    [(ram_what, ram_size)] = [line for line in training.lines if "offloaded" in line[0]]
    assert ram_size == 4 * sum(held) and "optimizer state and EMA copy" in ram_what
    fused = make_config(tempera_cache, tmp_path, *FINE_TUNE)
    assert memory_check.offload_candidates(fused, blocks) == [f"model.offload_blocks={blocks}"]
    plain = ("training.method=FINE_TUNE",)
    assert memory_check.offload_candidates(make_config(tempera_cache, tmp_path, *plain),
                                           blocks) == [
        f"training.fused_backward=true --set model.offload_blocks={blocks}"]
    assert memory_check.offload_candidates(make_config(
        tempera_cache, tmp_path, *plain, "training.gradient_accumulation=2"), blocks) == []


def test_a_fine_tune_too_big_is_offered_offload_with_the_fused_pass(tempera_cache, tmp_path,
                                                                    monkeypatch):
    """The refusal of a plain fine-tune over the card offers every block offloaded together
    with the fused pass it needs (with what both save, more than the fused pass alone), and
    offers neither where the fused pass cannot combine (gradient accumulation)."""
    from tests.train.test_memory_plan import MIB, fake_card

    fake_card(monkeypatch, 1 * MIB)
    plain = make_config(tempera_cache, tmp_path / "out", "training.method=FINE_TUNE")
    with pytest.raises(ConfigError) as caught:
        train(plain, RecordingCallbacks())
    message = str(caught.value)
    both = re.search(r"--set training\.fused_backward=true --set model\.offload_blocks=\d+ "
                     r"saves ([\d.,]+) MiB [^;]*; costs: ([^)]*)\)", message)
    alone = re.search(r"--set training\.fused_backward=true saves ([\d.,]+) MiB", message)
    assert both and alone, message
    assert float(both[1]) > float(alone[1])
    assert "one optimizer per weight" in both[2] and "steps their optimizer there" in both[2]
    with pytest.raises(ConfigError) as caught:
        train(make_config(tempera_cache, tmp_path / "out", "training.method=FINE_TUNE",
                          "training.gradient_accumulation=2"), RecordingCallbacks())
    assert "model.offload_blocks" not in str(caught.value)
    assert not (tmp_path / "out").exists()
