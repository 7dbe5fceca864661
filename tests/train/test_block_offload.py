"""Block offload (`model.offload_blocks`, issue 46 item 2) on the CPU: the schedule as data; the
streamer observed on the tiny UNet (its own event log against the schedule, the weights'
storage swapped between the host copy and a resident copy, nothing resident after a step, with
and without gradient checkpointing); training with it equals training without, bit for bit,
resumes exactly, is recorded in run.json and compiles REGIONAL AOT_EAGER with no graph break and
no recompile; refused for a full fine-tune and a FULL compile. Speed, overlap and peak memory
are a GPU measurement (docs/gpu.md)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from modules.config import ConfigError
from modules.config.overrides import apply_overrides
from modules.config.schema import Config
from modules.config.validate import validate
from modules.events import RecordingCallbacks
from modules.models.families import family_of
from modules.models.loader import load_bundle
from modules.models.tiny import ensure_builtin_model
from modules.train.memory.offload import (block_bytes, build_streamer, choose_blocks,
                                          held_on_host, in_flight_bytes, offload_choice,
                                          stream_schedule)
from modules.train.recipe.trainable import component_dtypes, prepare_trainable
from modules.train.trainer import train
from tests.train.lever_runs import (REGIONAL_AOT_EAGER, LeverRuns, make_config,
                                    train_counting_dynamo)
from tests.train.test_resume import (assert_resumed_as, final_tensors, run_json,
                                     stop_then_resume)

OFFLOAD = "model.offload_blocks=3"


# ------------------------------------------------------------------ the schedule, as data
def test_the_largest_blocks_are_chosen_and_two_are_in_flight():
    sizes = [10, 40, 40, 5, 30]
    assert choose_blocks(sizes, 2) == [1, 2]  # the largest; ties: the earlier block
    assert choose_blocks(sizes, 3) == [1, 2, 4]
    assert choose_blocks(sizes, 9) == [0, 1, 2, 3, 4]
    assert in_flight_bytes(sizes, [1, 2, 4]) == 80
    assert in_flight_bytes(sizes, [3]) == 5


def test_schedule_prefetches_one_ahead_forward_and_backward():
    # call order 2, 0, 1, 3; blocks 0, 1, 3 offloaded; block 0 takes no part in backward
    events = [(e.phase, e.point, e.at, e.action, e.block)
              for e in stream_schedule([2, 0, 1, 3], {0, 1, 3}, backward={1, 2, 3})]
    assert events == [
        ("forward", "before", 0, "fetch", 0), ("forward", "before", 0, "prefetch", 1),
        ("forward", "after", 0, "evict", 0),
        ("forward", "before", 1, "prefetch", 3), ("forward", "after", 1, "evict", 1),
        ("forward", "after", 3, "evict", 3),
        ("backward", "before", 3, "fetch", 3), ("backward", "before", 3, "prefetch", 1),
        ("backward", "before", 1, "evict", 3),
        ("backward", "end", -1, "evict", 1)]


# ------------------------------------------------------------------ the streamer, observed
@pytest.fixture(scope="module")
def unet_parts(tempera_cache, tmp_path_factory):
    """The tiny UNet with a LoRA (as training prepares it) and one batch of its inputs."""
    config = make_config(tempera_cache, tmp_path_factory.mktemp("offload-unet"))
    folder = ensure_builtin_model(config.model.path, tempera_cache)
    bundle = load_bundle(folder, config.model, component_dtypes(config))
    prepare_trainable(bundle, config)
    unet = bundle.denoiser
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, unet.config.in_channels, 8, 8, generator=generator),
              torch.tensor([10, 500]),
              torch.randn(2, 4, unet.config.cross_attention_dim, generator=generator))
    return bundle, inputs


def one_step(unet, inputs, streamer=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if streamer is not None:
        streamer.begin()
    out = unet(*inputs).sample
    out.square().mean().backward()
    if streamer is not None:
        streamer.end()
    grads = {n: p.grad.clone() for n, p in unet.named_parameters() if p.grad is not None}
    unet.zero_grad(set_to_none=True)
    return out.detach(), grads


def streamer_for(bundle, count: int):
    """The streamer (on the CPU) for the ``count`` largest of the bundle's denoiser blocks."""
    names = family_of(bundle.model_type).repeated_blocks
    return build_streamer(offload_choice(bundle.denoiser, names, count), torch.device("cpu"))


def test_streamer_follows_its_schedule_and_leaves_nothing_resident(unet_parts):
    """With gradient checkpointing, whose re-run forwards happen in backward (without it: the
    training runs below). Over 10 s: three forward and backward passes of the tiny UNet."""
    bundle, inputs = unet_parts
    unet = bundle.denoiser
    unet.enable_gradient_checkpointing()
    try:
        want_out, want_grads = one_step(unet, inputs)
        streamer = streamer_for(bundle, 3)
        assert streamer is not None and len(streamer.offloaded) == 3
        sizes = [block_bytes(b) for b in streamer.blocks]
        assert streamer.offloaded == choose_blocks(sizes, 3)
        hosts = {i: [t.data_ptr() for t in streamer.host_tensors(i)]
                 for i in streamer.offloaded}
        seen: dict[int, list[int]] = {}  # the storage each block ran with

        def watch(block, args, i):
            seen[i] = [p.data_ptr() for p in block.parameters() if not p.requires_grad]
        handles = [streamer.blocks[i].register_forward_pre_hook(
            lambda m, a, i=i: watch(m, a, i)) for i in streamer.offloaded]
        try:
            for _ in range(2):  # the second step prefetches in the order the first learned
                out, grads = one_step(unet, inputs, streamer)
        finally:
            for handle in handles:
                handle.remove()
            log = list(streamer.log)
            order, backward = list(streamer.order), set(streamer.backward_blocks)
            resident = streamer.resident()
            after = {i: [p.data_ptr() for p in streamer.blocks[i].parameters()
                         if not p.requires_grad] for i in streamer.offloaded}
            streamer.close()
    finally:
        unet.disable_gradient_checkpointing()
    assert log == stream_schedule(order, streamer.offloaded, backward)
    assert any(e.phase == "backward" for e in log) and backward
    assert resident == set() and after == hosts  # every offloaded weight back on the host
    for i in streamer.offloaded:  # each block ran on a resident copy, not its host storage
        assert not set(seen[i]) & set(hosts[i])
    assert torch.equal(out, want_out)
    assert want_grads.keys() == grads.keys()
    assert all(torch.equal(want_grads[n], grads[n]) for n in want_grads)


def test_loading_leaves_the_offloaded_blocks_frozen_weights_in_cpu_memory(tempera_cache,
                                                                          tmp_path):
    """Placing the denoiser on the device never holds the offloaded blocks' frozen weights
    there (the load's peak is the rest of the model). A CPU has no second device to watch
    weights leave for, so the move here is a conversion every weight visibly undergoes (to
    float64: `.to(device)` and `.to(dtype)` are the same `Module._apply`, which changes each
    parameter's data in place): inside `held_on_host` the chosen blocks' frozen weights come
    out the same storage, while their LoRA weights and everything else converted."""
    config = make_config(tempera_cache, tmp_path)
    bundle = load_bundle(ensure_builtin_model(config.model.path, tempera_cache), config.model,
                         component_dtypes(config))
    prepare_trainable(bundle, config)
    unet, names = bundle.denoiser, family_of(bundle.model_type).repeated_blocks
    choice = offload_choice(unet, names, 100)  # every block: some hold LoRA weights
    assert choice is not None
    blocks, chosen = choice.blocks, choice.chosen
    params = list(unet.parameters())
    kept = {id(p): p.data for i in chosen for p in blocks[i].parameters()
            if not p.requires_grad}
    lora = [p for i in chosen for p in blocks[i].parameters() if p.requires_grad]
    assert kept and lora and len(chosen) == len(blocks)
    assert len(kept) < len(params) - len(lora)  # weights outside the blocks too
    with held_on_host(choice):
        unet.to(torch.float64)
    assert list(unet.parameters()) == params  # the same parameters, their data changed
    for param in params:
        if id(param) in kept:
            assert param.data_ptr() == kept[id(param)].data_ptr()
            assert param.dtype == torch.float32
        else:
            assert param.dtype == torch.float64


def test_streamer_never_moves_trained_weights(unet_parts):
    bundle, _ = unet_parts
    streamer = streamer_for(bundle, 100)
    assert streamer is not None
    try:
        moved = {id(p) for i in streamer.offloaded for p, _ in streamer._host[i]}
        trained = [p for p in bundle.denoiser.parameters() if p.requires_grad]
        assert trained and not moved & {id(p) for p in trained}
        assert len(streamer.offloaded) == len(streamer.blocks)  # capped at the block count
    finally:
        streamer.close()


def test_a_pass_aside_streams_alone_and_keeps_the_training_order(unet_parts):
    """Sampling and validation run their forwards inside `BlockStreamer.aside` (through
    `Run.outside_training`): the pass's log is its own forward schedule, nothing stays resident
    after it, even when it raised in the middle of a forward, and the next training step
    prefetches in the order training learned (a pass that raised after its first block would
    otherwise teach it a one-block order)."""
    bundle, inputs = unet_parts
    unet = bundle.denoiser
    streamer = streamer_for(bundle, 3)
    assert streamer is not None
    try:
        one_step(unet, inputs, streamer)
        learned, step_log = list(streamer.order), list(streamer.log)
        hosts = {i: [t.data_ptr() for t in streamer.host_tensors(i)] for i in streamer.offloaded}
        with streamer.aside(), torch.no_grad():
            unet(*inputs)
        assert streamer.log == stream_schedule(learned, streamer.offloaded, backward=())
        assert streamer.resident() == set() and not streamer._pending
        first, second = learned[0], learned[1]

        def fail(module, args):
            raise RuntimeError("a pass stopped in the middle of a forward")
        handle = streamer.blocks[second].register_forward_pre_hook(fail)
        try:
            with pytest.raises(RuntimeError, match="middle of a forward"):
                with streamer.aside(), torch.no_grad():
                    unet(*inputs)
        finally:
            handle.remove()
        assert [e.block for e in streamer.log if e.action == "fetch"] == [first]
        assert streamer.resident() == set() and not streamer._pending
        assert streamer.order == learned
        assert {i: [p.data_ptr() for p in streamer.blocks[i].parameters()
                    if not p.requires_grad] for i in streamer.offloaded} == hosts
        one_step(unet, inputs, streamer)
        assert streamer.log == step_log
    finally:
        streamer.close()


# ------------------------------------------------------------------ training with it
# the compiled run also samples and validates after each of its 2 steps
PASSES = ('sampling.prompts=["a red circle"]', "sampling.every_steps=1", "sampling.steps=2",
          "validation.every_steps=1", "validation.split_ratio=0.25", "validation.timesteps=2")


Ended = list[tuple[list, list[int], set[int], set[int]]]


@dataclass
class OffloadRuns(LeverRuns):
    """The lever's runs, and what each block streamer did when it ended (its log, its call
    order, its backward blocks and the blocks it left resident or pending), per run."""
    ended: dict[str, Ended]


@pytest.fixture(scope="module")
def runs(tempera_cache, tmp_path_factory) -> OffloadRuns:
    """The shared runs (2 steps each on the tiny model, as tests/train/lever_runs.py builds
    them): "plain" without offload, 3 blocks offloaded stopped at step 1 and resumed (equal to
    the first: offload changes nothing and resumes exactly), and under REGIONAL AOT_EAGER with
    gradient checkpointing, sampling and validating after each step; the streamers' ends of the
    last two recorded. Over 10 s: four short trainings, one compiled, 2 samples, 2 validation
    passes."""
    from modules.train.memory import offload

    root = tmp_path_factory.mktemp("block-offload")
    out = {name: root / name for name in ("plain", "resumed", "compiled")}
    ended: dict[str, Ended] = {"resumed": [], "compiled": []}
    real_end = offload.BlockStreamer.end
    recording = ended["resumed"]

    def end(self):  # what the step or pass did, in the order it prefetched in
        order, backward = list(self.order), set(self.backward_blocks)
        real_end(self)
        recording.append((list(self.log), order, backward, self.resident() | set(self._pending)))
    train(make_config(tempera_cache, out["plain"]), RecordingCallbacks())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offload.BlockStreamer, "end", end)
        stop_then_resume(make_config(tempera_cache, out["resumed"], OFFLOAD), at=1)
        recording = ended["compiled"]
        breaks, recompiles = train_counting_dynamo(make_config(
            tempera_cache, out["compiled"], OFFLOAD, *REGIONAL_AOT_EAGER,
            "training.gradient_checkpointing=true", *PASSES))
    return OffloadRuns(out, breaks, recompiles, ended)


def test_offloaded_run_resumes_to_the_run_without(runs):
    """The offloaded run, stopped after step 1 and resumed, equals the unbroken run without
    offload bit for bit: the losses step by step and the saved LoRA."""
    assert_resumed_as(runs.out["plain"], runs.out["resumed"])


def test_run_record_says_which_blocks(runs):
    out = runs.out
    record = run_json(out["resumed"])["block_offload"]
    assert record["blocks"] == 3 and record["of"] > 3 and len(record["offloaded"]) == 3
    assert record["offloaded_bytes"] > record["in_flight_bytes"] > 0
    assert run_json(out["plain"])["block_offload"] == {"blocks": 0}


def test_offload_keeps_regional_compile_without_graph_breaks(runs):
    breaks, recompiles = runs.graph_breaks, runs.recompiles
    report = run_json(runs.out["compiled"])["compile"]["unet"]
    assert report["effective"] == "AOT_EAGER" and report["scope"] == "REGIONAL", report
    assert report["compiled_code_ran"] and not report["degraded"], report
    assert breaks == {}, breaks
    assert recompiles == {}, recompiles
    # dynamo (torch 2.13) no longer counts recompiles in counters["recompiles"]: the compile
    # engine's own count is the check that can fail (none after the first step)
    assert report["late_recompiles"] == 0, report


def test_sampling_and_validation_passes_leave_each_step_its_schedule(runs):
    """The compiled run samples and validates after each of its 2 steps: every pass streams the
    offloaded blocks as a forward schedule of its own (one per denoiser call) and leaves none on
    the device, and each training step's log is the schedule of training's order (gradient
    checkpointing's re-run forwards included), the same order before and after the passes. The
    offloaded eager run's steps (no checkpointing, stopped and resumed) follow it too."""
    out = runs.out["compiled"]
    assert run_json(out)["validation"] and list((out / "samples").rglob("*.png"))
    for name, ended in runs.ended.items():
        offloaded = sorted(int(block.split(":")[0])
                           for block in run_json(runs.out[name])["block_offload"]["offloaded"])
        steps = [e for e in ended if any(ev.phase == "backward" for ev in e[0])]
        passes = [e for e in ended if e not in steps]
        assert len(steps) == 2, name
        training_order = steps[0][1]
        for log, order, backward, left in steps:
            assert order == training_order and left == set(), name
            assert log == stream_schedule(order, offloaded, backward), name
        if name == "resumed":
            assert passes == []
            continue
        assert len(passes) >= 4  # a sample and a validation pass per step
        one_forward = stream_schedule(training_order, offloaded, backward=())
        for log, order, _, left in passes:
            assert order == training_order and left == set()
            calls = len(log) // len(one_forward)
            assert calls >= 1 and log == one_forward * calls


def test_zimage_lora_trains_with_offload_as_without(zimage_folder, tempera_cache, tmp_path,
                                                   monkeypatch):
    """The tiny Z-Image (its refiners and main layers are blocks of one class, the ones REGIONAL
    compiles; the LoRA sits on the main layers only): 3 of its 4 blocks offloaded, compiled
    REGIONAL AOT_EAGER, 2 steps equal the eager run without offload bit for bit (losses and
    the saved LoRA), the blocks streamed forward and backward, no graph break and no recompile
    after the first step. Over 10 s: two short trainings, one compiled."""
    from modules.train.memory import offload

    logs: list[list] = []
    real_end = offload.BlockStreamer.end

    def end(self):
        real_end(self)
        logs.append(list(self.log))
    monkeypatch.setattr(offload.BlockStreamer, "end", end)
    zimage = ("model.type=ZIMAGE", "model.path=builtin:tiny-zimage")
    train(make_config(tempera_cache, tmp_path / "off", *zimage), RecordingCallbacks())
    breaks, _ = train_counting_dynamo(make_config(tempera_cache, tmp_path / "on", *zimage,
                                                  OFFLOAD, *REGIONAL_AOT_EAGER))
    off, on = run_json(tmp_path / "off"), run_json(tmp_path / "on")
    assert on["block_offload"]["blocks"] == 3 and on["block_offload"]["of"] == 4
    assert on["losses"] == off["losses"] and len(on["losses"]) == 2
    want, have = final_tensors(tmp_path / "off"), final_tensors(tmp_path / "on")
    assert want.keys() == have.keys() and want
    assert all(torch.equal(want[key], have[key]) for key in want)
    assert len(logs) == 2 and all(
        {(e.phase, e.action) for e in log} >= {("forward", "fetch"), ("backward", "fetch")}
        for log in logs)
    [report] = [r for r in on["compile"].values() if r["scope"] == "REGIONAL"
                and r["effective"] == "AOT_EAGER"]
    assert report["compiled_code_ran"] and not report["degraded"], report
    assert breaks == {} and report["late_recompiles"] == 0, (breaks, report)


# ------------------------------------------------------------------ refused
@pytest.mark.parametrize("setting, reason", [
    ("training.method=FINE_TUNE", "only the fused backward pass does"),
    ("compile.scope=FULL", "use compile.scope=REGIONAL")])
def test_offload_is_refused_where_it_cannot_work(tmp_path, setting, reason):
    config = apply_overrides(Config(), [f"output.dir={tmp_path}", OFFLOAD, setting])
    found = [p for p in validate(config) if p.path == "model.offload_blocks"]
    assert found and reason in str(found[0]), found
    with pytest.raises(ConfigError, match="model.offload_blocks"):
        train(config, RecordingCallbacks())


# ------------------------------------------------------------------ the memory plan
def test_plan_counts_the_offloaded_blocks_as_the_real_ones_hold_them(unet_parts, tempera_cache,
                                                                     tmp_path):
    """The plan's offload line (weightless copies) is the real loaded blocks' bytes less the
    two in flight, for the blocks the streamer picks."""
    import modules.train.memory.memory_check as memory_check
    from modules.train.memory.memory_plan import plan_memory

    bundle, _ = unet_parts
    config = make_config(tempera_cache, tmp_path / "out", OFFLOAD)
    folder = ensure_builtin_model(config.model.path, tempera_cache)
    streamer = streamer_for(bundle, 3)
    assert streamer is not None
    try:
        held = [sum(t.numel() * t.element_size() for t in streamer.host_tensors(i))
                for i in streamer.offloaded]
    finally:
        streamer.close()
    plan = plan_memory(config, folder)
    [(what, size)] = [line for line in plan.lines if "blocks offloaded" in line[0]]
    assert size == sorted(held)[-1] + sorted(held)[-2] - sum(held), what
    off = plan_memory(make_config(tempera_cache, tmp_path / "out"), folder)
    assert off.total - plan.total == -size > 0
    # the refusal offers offloading every block, with what it saves
    blocks = len(streamer.blocks)
    assert memory_check.offload_candidates(make_config(tempera_cache, tmp_path), blocks) == [
        f"model.offload_blocks={blocks}"]
    assert memory_check.offload_candidates(config, blocks) == []
    fixes = dict(memory_check.memory_fixes(make_config(tempera_cache, tmp_path), folder, off))
    everything = plan_memory(make_config(tempera_cache, tmp_path,
                                         f"model.offload_blocks={blocks}"), folder)
    assert fixes[f"model.offload_blocks={blocks}"] == off.total - everything.total > 0


def test_the_field_sits_in_the_model_group_and_is_greyed_for_a_full_fine_tune():
    """The GUI builds its widget from this metadata (app/form.py): Model, behind More options."""
    from modules.config.field_rules import unused_fields
    from modules.config.introspect import field_map

    info = field_map(Config)["model.offload_blocks"]
    assert info.group == "Model" and info.advanced and info.label == "Offloaded blocks"
    assert all(word in info.help for word in ("Saves", "costs", "LoRA", "REGIONAL"))
    assert "model.offload_blocks" in unused_fields(
        apply_overrides(Config(), ["training.method=FINE_TUNE"]))
    assert "model.offload_blocks" not in unused_fields(Config())
