"""The GPU memory plan (modules/train/memory/memory_plan.py, memory_check.py): its arithmetic on the
tiny model against parameters counted here, its optimizer state against what each optimizer
really allocates, the refusal of a run too big for a (monkeypatched) card through the real
entry points with the output folder untouched, the warning band, and no check off CUDA."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import modules.train.memory.memory_check as memory_check
from modules.cli.train import main
from modules.config import ConfigError
from modules.config.loader import save_config
from modules.config.optimizers import OPTIMIZERS
from modules.config.schema import Optimizer
from modules.events import RecordingCallbacks
from modules.models.loader import load_bundle
from modules.train.memory.memory_check import CardMemory, card_memory
from modules.train.memory.memory_plan import gib, optimizer_state_bytes, state_bytes
from modules.train.setup.prepare import check_run
from modules.train.trainer import train
from modules.train.recipe.trainable import component_dtypes

MIB = 2 ** 20
FINE_TUNE = ("training.method=FINE_TUNE",)


# ------------------------------------------------------------------------ optimizer state
def test_state_kinds_by_hand():
    conv = (320, 640, 3, 3)  # a UNet convolution: factored over its last two dimensions
    assert state_bytes("copy", conv, 4) == 320 * 640 * 9 * 4
    assert state_bytes("bf16_copy", conv, 4) == 320 * 640 * 9 * 2
    assert state_bytes("factored", conv, 2) == (320 * 640 * 3 + 320 * 640 * 3) * 2
    assert state_bytes("factored", (77,), 4) == 77 * 4          # 1-D: a full copy
    assert state_bytes("factored_only", (77,), 4) == 0
    assert state_bytes("8bit", (1024, 1024), 4) == 1024 * 1024 + 1024 * 1024 // 256 * 4
    assert state_bytes("8bit", (4095,), 2) == 4095 * 4          # small: float32 state


def real_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every state tensor the optimizer holds (step counters, 0-d, left out)."""
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("optimizer", [o for o in Optimizer if not OPTIMIZERS[o].needs_cuda])
def test_optimizer_state_matches_what_the_optimizer_allocates(optimizer, dtype):
    import importlib
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Conv2d(4, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 5)).to(dtype)
    params = list(layers.parameters())
    row = OPTIMIZERS[optimizer]
    opt = getattr(importlib.import_module(row.module), row.cls)(params, lr=1e-3, **row.options)
    layers(torch.randn(2, 4, 8, 8, dtype=dtype)).float().square().mean().backward()
    opt.step()
    assert optimizer_state_bytes(optimizer, params) == real_state_bytes(opt)


# ------------------------------------------------------------------- the plan, counted here
def tiny_model(config):
    """The tiny model, really loaded, at the dtypes a run loads it at."""
    checked = check_run(config, RecordingCallbacks())
    return checked, load_bundle(checked.model_path, config.model, component_dtypes(config))


def size(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def lines(plan) -> dict[str, int]:
    return {what.split(" (")[0]: n for what, n in plan.lines}


def test_fine_tune_plan_on_the_tiny_model(tiny_config):
    config = tiny_config(*FINE_TUNE)
    checked, bundle = tiny_model(config)
    unet = sum(p.numel() for p in bundle.denoiser.parameters()) * 4  # fp32
    frozen = size(bundle.text_encoders["text_encoder"]) + size(bundle.vae)
    plan = checked.memory.plan
    assert lines(plan)["unet trained weights"] == unet
    assert lines(plan)["gradients of the trained weights"] == unet
    assert lines(plan)["optimizer state"] == 2 * unet  # AdamW: two fp32 moments
    assert plan.total == frozen + 4 * unet
    assert checked.memory.card is None and checked.memory.warnings == []  # CPU: no card

    with_ema = check_run(tiny_config(*FINE_TUNE, "training.ema=true"), RecordingCallbacks())
    assert with_ema.memory.plan.total == plan.total + unet
    lion = check_run(tiny_config(*FINE_TUNE, "training.optimizer=LION",
                                 "training.learning_rate=1e-4"), RecordingCallbacks())
    assert lion.memory.plan.total == plan.total - unet
    # with both caches the VAE and the text encoder stay on the CPU (train/recipe/placement.py)
    cached = check_run(tiny_config(*FINE_TUNE, "data.cache_latents=true",
                                   "data.cache_text_encoder_outputs=true"), RecordingCallbacks())
    assert cached.memory.plan.total == plan.total - size(bundle.vae) - size(
        bundle.text_encoders["text_encoder"])


def test_lora_plan_counts_the_adapters_by_hand(tiny_config):
    config = tiny_config("training.lora_rank=4")
    checked, bundle = tiny_model(config)
    targets = config.training.lora_target_modules
    adapters = sum(4 * (m.in_features + m.out_features) for name, m in
                   bundle.denoiser.named_modules()
                   if isinstance(m, nn.Linear) and any(name.endswith(t) for t in targets))
    adapter_bytes = adapters * 4  # fp32
    assert adapters > 0
    plan = checked.memory.plan
    assert lines(plan)["unet LoRA adapters"] == adapter_bytes
    assert lines(plan)["unet weights"] == size(bundle.denoiser)
    assert plan.total == (size(bundle.denoiser) + size(bundle.text_encoders["text_encoder"])
                          + size(bundle.vae) + 4 * adapter_bytes)  # weights, grads, 2 moments


def test_a_trained_text_encoder_is_counted_as_trained(tiny_config):
    config = tiny_config(*FINE_TUNE, "components.text_encoder.train=true")
    checked, bundle = tiny_model(config)
    encoder = bundle.text_encoders["text_encoder"]
    trained = sum(p.numel() for p in encoder.parameters()) * 4
    assert lines(checked.memory.plan)["text_encoder trained weights"] == trained
    assert lines(checked.memory.plan)["text_encoder weights"] == size(encoder) - trained  # buffers


# -------------------------------------------------------------------- against a (fake) card
def fake_card(monkeypatch, total: int, free: int | None = None) -> None:
    monkeypatch.setattr(memory_check, "card_memory",
                        lambda device: CardMemory("Test GPU 1", total, total if free is None
                                                  else free))


def test_a_run_too_big_for_the_card_is_refused_before_the_output_folder_is_touched(
        tiny_config, tmp_path, monkeypatch):
    config = tiny_config(*FINE_TUNE, "training.ema=true")
    out = tmp_path / "out"
    (out / "checkpoints" / "step-5").mkdir(parents=True)
    weights = out / "checkpoints" / "step-5" / "model.safetensors"
    weights.write_bytes(b"earlier weights")
    before = {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
              for p in out.rglob("*")}
    total = check_run_plan_total(config)  # no card yet: the plan alone
    assert total > MIB
    fake_card(monkeypatch, 1 * MIB)
    with pytest.raises(ConfigError) as caught:
        train(config, RecordingCallbacks())
    [problem] = caught.value.problems
    text = str(problem)
    assert problem.path == "training.method"
    assert "Test GPU 1's 1.00 MiB" in text and "FINE_TUNE with AdamW" in text
    assert "unet trained weights (fp32" in text and "optimizer state (AdamW" in text
    assert "--set training.method=LORA saves" in text and "--set training.ema=false saves" in text
    assert "training.optimizer=LION (Lion)" in text or "ADAFACTOR" in text
    assert f"needs at least {total / MIB:,.2f} MiB before activations" in text
    after = {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
             for p in out.rglob("*")}
    assert after == before  # nothing written, nothing removed: no lock, no run.json


def check_run_plan_total(config) -> int:
    return check_run(config, RecordingCallbacks()).memory.plan.total


def test_check_prints_the_plan_and_exits_2_when_it_cannot_fit(tiny_config, tmp_path,
                                                              monkeypatch, capsys):
    path = tmp_path / "run.json"
    save_config(tiny_config(*FINE_TUNE), path)
    assert main(["--config", str(path), "--check"]) == 0
    printed = capsys.readouterr().out
    assert "memory plan (no CUDA device here to compare with):" in printed
    assert "unet trained weights (fp32" in printed and "total:" in printed
    fake_card(monkeypatch, 1 * MIB)
    assert main(["--config", str(path), "--check"]) == 2
    assert "training.method: expected a run whose weights" in capsys.readouterr().err


def test_a_plan_near_the_card_warns_and_trains(tiny_config, monkeypatch):
    config = tiny_config(*FINE_TUNE, "training.max_steps=1")
    total = check_run_plan_total(config)
    fake_card(monkeypatch, math.ceil(total / 0.95))
    callbacks = RecordingCallbacks()
    result = train(config, callbacks)
    warned = [s for s in callbacks.statuses if s.startswith("memory: ")]
    assert len(warned) == 1 and "activations will likely not fit" in warned[0]
    assert "training.method=LORA saves" in warned[0]
    recorded = json.loads((result.output_dir / "run.json").read_text())["memory_plan"]
    assert recorded["total_bytes"] == total
    assert recorded["card"] == {"name": "Test GPU 1", "total_bytes": math.ceil(total / 0.95)}
    assert sum(line["bytes"] for line in recorded["lines"]) == total


def test_memory_held_by_others_warns_but_does_not_refuse(tiny_config, monkeypatch):
    config = tiny_config(*FINE_TUNE)
    total = check_run_plan_total(config)
    fake_card(monkeypatch, 100 * total, free=total // 2)
    callbacks = RecordingCallbacks()
    check_run(config, callbacks)
    assert any("other processes hold the rest" in s for s in callbacks.statuses)
    # and the log says what the plan takes of the card, in one line
    summary = [s for s in callbacks.statuses if s.startswith("memory plan: ")]
    assert summary == [f"memory plan: at least {gib(total)} of Test GPU 1's {gib(100 * total)} "
                       "(1%) before activations; run.json's memory_plan itemises it"]


def test_no_card_off_cuda(tiny_config):
    assert card_memory(torch.device("cpu")) is None
    callbacks = RecordingCallbacks()
    result = train(tiny_config("training.max_steps=1"), callbacks)
    recorded = json.loads((result.output_dir / "run.json").read_text())["memory_plan"]
    assert recorded["card"] is None and recorded["total_bytes"] > 0
    assert not any(s.startswith("memory: ") for s in callbacks.statuses)


def test_a_plan_that_cannot_be_computed_stops_nothing_and_says_so(tiny_config, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("no config.json for this denoiser")
    monkeypatch.setattr(memory_check, "weightless_bundle", broken)
    fake_card(monkeypatch, 1 * MIB)  # would refuse, had the plan been computed
    callbacks = RecordingCallbacks()
    checked = check_run(tiny_config(*FINE_TUNE), callbacks)
    assert checked.memory.plan is None
    assert any(s.startswith("memory: the memory plan could not be computed (ValueError: no "
                            "config.json for this denoiser): no up-front memory check")
               for s in callbacks.statuses), callbacks.statuses
    assert checked.memory.record()["total_bytes"] is None
    assert checked.memory.describe()[1] == "  not computed"


def test_gib_reads_sizes_by_their_magnitude_below_zero_too():
    assert gib(3 * 2 ** 30 // 2) == "1.50 GiB"
    assert gib(-3 * 2 ** 30 // 2) == "-1.50 GiB"  # a difference: not "-1,572,864.0 KiB"
    assert gib(-5 * 2 ** 20) == "-5.00 MiB"
    assert gib(512) == "0.5 KiB"
