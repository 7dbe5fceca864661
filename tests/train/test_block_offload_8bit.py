"""Block offload (`model.offload_blocks`) of frozen weights stored in 8 bits
(`model.weight_storage` INT8, FLOAT8 and W8A8; issue 56 item 7, issue 58) on the CPU: the
streamer moves each stored weight's values and scales (torchao's tensor subclasses hold them as
inner tensors, which `.data =` alone would not swap), loading keeps them in CPU memory, a
2-step LoRA run with every block offloaded equals the run without offload bit for bit (INT8,
W8A8), the memory plan counts the offloaded blocks at their stored bytes and the refusal offers
the two levers together. Under REGIONAL AOT_EAGER with no graph break and no recompile: the
compiled runs of tests/train/test_weight_storage.py (INT8, FLOAT8) and test_w8a8.py offload
every block. Speed, overlap and peak memory on a GPU are the GPU
phase's (docs/gpu.md): not measured here."""
from __future__ import annotations

import pytest
import torch

from modules.events import RecordingCallbacks
from modules.models.families import family_of
from modules.models.loader import load_bundle
from modules.models.tiny import ensure_builtin_model
from modules.models.weight_storage import is_stored, stored_bytes
from modules.train.memory.offload import (build_streamer, held_on_host, offload_choice,
                                          storage_pointers)
from modules.train.recipe.trainable import component_dtypes, prepare_trainable
from modules.train.trainer import train
from tests.train.lever_runs import make_config
from tests.train.test_block_offload import one_step
from tests.train.test_resume import final_tensors, run_json

pytest.importorskip("torchao")

STORAGES = ("INT8", "FLOAT8", "W8A8")
EVERY_BLOCK = "model.offload_blocks=100"  # capped at the block count: each kind of block


def stored_bundle(cache, out, storage: str):
    """The tiny SD 1.5 model with its frozen linear weights stored as ``storage`` and a LoRA,
    as training prepares it."""
    config = make_config(cache, out, f"model.weight_storage={storage}")
    bundle = load_bundle(ensure_builtin_model(config.model.path, cache), config.model,
                         component_dtypes(config))
    prepare_trainable(bundle, config)
    return bundle


@pytest.mark.parametrize("storage", STORAGES)
def test_streamer_moves_the_stored_values_and_scales(storage, tempera_cache, tmp_path):
    """Each offloaded block runs on fresh copies of its stored weights (values and scales: no
    pointer shared with the host copy) and holds the host copy again after the step; the
    output and the gradients equal the step without offload."""
    bundle = stored_bundle(tempera_cache, tmp_path, storage)
    unet = bundle.denoiser
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, unet.config.in_channels, 8, 8, generator=generator),
              torch.tensor([10, 500]),
              torch.randn(2, 4, unet.config.cross_attention_dim, generator=generator))
    want_out, want_grads = one_step(unet, inputs)
    names = family_of(bundle.model_type).repeated_blocks
    streamer = build_streamer(offload_choice(unet, names, 100), torch.device("cpu"))
    assert streamer is not None

    def frozen_pointers(i: int) -> list[int]:
        return [ptr for p in streamer.blocks[i].parameters() if not p.requires_grad
                for ptr in storage_pointers(p)]
    stored = [p for i in streamer.offloaded for p, _ in streamer._host[i] if is_stored(p)]
    assert stored and 0 not in frozen_pointers(streamer.offloaded[0])
    hosts = {i: frozen_pointers(i) for i in streamer.offloaded}
    seen: dict[int, list[int]] = {}
    handles = [streamer.blocks[i].register_forward_pre_hook(
        lambda m, a, i=i: seen.__setitem__(i, frozen_pointers(i))) for i in streamer.offloaded]
    try:
        out, grads = one_step(unet, inputs, streamer)
        after = {i: frozen_pointers(i) for i in streamer.offloaded}
    finally:
        for handle in handles:
            handle.remove()
        streamer.close()
    assert after == hosts
    for i in streamer.offloaded:
        assert not set(seen[i]) & set(hosts[i]), i
    assert all(type(p).__name__ == type(stored[0]).__name__ for p in stored)  # still stored
    assert torch.equal(out, want_out)
    assert want_grads.keys() == grads.keys()
    assert all(torch.equal(want_grads[n], grads[n]) for n in want_grads)


def test_loading_keeps_the_stored_weights_of_offloaded_blocks_in_cpu_memory(tempera_cache,
                                                                            tmp_path):
    """Inside `held_on_host` a conversion of the whole denoiser (to float64: the same
    `Module._apply` as `.to(device)`, which for torchao's tensors swaps the whole subclass)
    leaves the offloaded blocks' INT8 weights as they were, values and scales in the same
    storage; the other weights convert."""
    bundle = stored_bundle(tempera_cache, tmp_path, "INT8")
    unet, names = bundle.denoiser, family_of(bundle.model_type).repeated_blocks
    choice = offload_choice(unet, names, 100)
    assert choice is not None
    kept = {id(p): (p.dtype, storage_pointers(p)) for i in choice.chosen
            for p in choice.blocks[i].parameters() if not p.requires_grad}
    assert any(is_stored(p) for p in unet.parameters() if id(p) in kept)
    with held_on_host(choice):
        unet.to(torch.float64)
    for param in unet.parameters():
        if id(param) in kept:
            assert (param.dtype, storage_pointers(param)) == kept[id(param)]
        elif not is_stored(param):
            assert param.dtype == torch.float64


@pytest.fixture(scope="module", params=("INT8", "W8A8"))
def runs(request, tempera_cache, tmp_path_factory):
    """Per storage, 2 eager steps each: without offload ("plain") and with every block
    offloaded ("offloaded"). FLOAT8 trains the same way on this CPU (its streamer test
    above); its runs are left out for time."""
    storage = f"model.weight_storage={request.param}"
    root = tmp_path_factory.mktemp(f"offload-{request.param.lower()}")
    train(make_config(tempera_cache, root / "plain", storage), RecordingCallbacks())
    train(make_config(tempera_cache, root / "offloaded", storage, EVERY_BLOCK),
          RecordingCallbacks())
    return root


def test_offloaded_8_bit_run_equals_the_run_without(runs):
    plain, offloaded = run_json(runs / "plain"), run_json(runs / "offloaded")
    assert offloaded["block_offload"]["blocks"] == offloaded["block_offload"]["of"] > 3
    assert offloaded["weight_storage"] == plain["weight_storage"]
    assert offloaded["losses"] == plain["losses"] and len(plain["losses"]) == 2
    want, have = final_tensors(runs / "plain"), final_tensors(runs / "offloaded")
    assert want.keys() == have.keys() and want
    assert all(torch.equal(want[key], have[key]) for key in want)


@pytest.mark.parametrize("storage", ("INT8", "W8A8"))
def test_plan_counts_offloaded_blocks_at_their_stored_bytes(storage, tempera_cache, tmp_path):
    """The plan's offload line (weightless copies) is the stored blocks' bytes (values and
    scales) less the two largest in flight, as the loaded model holds them; W8A8's scales are
    buffers and stay on the device (not moved, not counted as moved)."""
    from modules.train.memory.memory_plan import plan_memory

    bundle = stored_bundle(tempera_cache, tmp_path, storage)
    names = family_of(bundle.model_type).repeated_blocks
    choice = offload_choice(bundle.denoiser, names, 3)
    assert choice is not None
    held = sorted(sum(stored_bytes(p) for p in choice.blocks[i].parameters()
                      if not p.requires_grad) for i in choice.chosen)
    config = make_config(tempera_cache, tmp_path, f"model.weight_storage={storage}",
                         "model.offload_blocks=3")
    plan = plan_memory(config, ensure_builtin_model(config.model.path, tempera_cache))
    [(what, size)] = [line for line in plan.lines if "blocks offloaded" in line[0]]
    assert size == held[-1] + held[-2] - sum(held) < 0, what


def test_refusal_and_check_offer_int8_and_offload_together(tempera_cache, tmp_path, monkeypatch):
    """A LoRA with neither lever on is offered the 8-bit storage the plan picks (INT8, on an
    RTX 30 card) with every block offloaded, as one `--set` list, with what the two save
    together (more than either alone) and what both cost; `--check` has a line for it. Over
    5 s: the tiny model planned about ten times."""
    import modules.train.memory.memory_check as memory_check
    from modules.config import ConfigError
    from modules.train.memory.levers import DeviceAbility
    from modules.train.memory.memory_check import CardMemory
    from modules.train.memory.memory_plan import gib, plan_memory

    rtx_3060 = DeviceAbility("RTX 3060 (sm_86)", (8, 6))
    config = make_config(tempera_cache, tmp_path)
    folder = ensure_builtin_model(config.model.path, tempera_cache)
    plan = plan_memory(config, folder)
    blocks = 12  # the tiny UNet's repeated blocks
    both = f"model.weight_storage=INT8 --set model.offload_blocks={blocks}"
    # the other candidates are tests/train/test_memory_plan.py's: only these are planned here
    monkeypatch.setattr(memory_check, "fix_candidates",
                        lambda config, ability: ["model.weight_storage=INT8"])
    fixes = dict(memory_check.memory_fixes(config, folder, plan, ability=rtx_3060))
    with_both = make_config(tempera_cache, tmp_path, "model.weight_storage=INT8",
                            f"model.offload_blocks={blocks}")
    together = plan_memory(with_both, folder)
    assert fixes[both] == plan.total - together.total
    assert fixes[both] > max(fixes["model.weight_storage=INT8"],
                             fixes[f"model.offload_blocks={blocks}"])
    report = memory_check.levers_report(config, folder, plan, ability=rtx_3060)
    [line] = [x for x in report if x.strip().startswith(memory_check.BOTH_LEVERS)]
    assert f"--set {both} saves {gib(fixes[both])}" in line and "block offload's" in line
    # neither is offered where one of them is on already
    assert memory_check.both_candidates(with_both, blocks, rtx_3060) == []
    monkeypatch.setattr(memory_check, "card_memory",
                        lambda device: CardMemory("Test GPU 1", 2 ** 20, 2 ** 20))
    monkeypatch.setattr(memory_check, "device_ability", lambda device: rtx_3060)
    with pytest.raises(ConfigError) as caught:
        memory_check.check_memory(config, folder, torch.device("cpu"))
    assert (f"--set {both} saves {gib(fixes[both])} (then {gib(together.total)}; costs: "
            "quality: a 2.3 % gap") in str(caught.value)
