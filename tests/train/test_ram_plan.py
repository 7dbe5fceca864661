"""The system RAM plan (train/memory/ram_plan.py, issue 58 item 4): its phases on a real-size
config (the shipped SD 1.5 configs, weightless: nothing loaded), and `check_memory` refusing a
run whose peak is more than the RAM given to it, with the change that fixes it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modules.config import ConfigError
from modules.config.loader import load_config
from modules.config.overrides import apply_overrides
from modules.models.tiny import ensure_builtin_model
from modules.train.memory import memory_check
from modules.train.memory.memory_plan import GIB, gib, plan_memory
from modules.train.memory.ram_plan import plan_ram
from modules.train.recipe.text_cache import RESIDENT_ROW_BYTES
from tests.train.lever_runs import make_config

REPO = Path(__file__).resolve().parents[2]
DATA = 'data.datasets=[{"path": "builtin:shapes"}]'
SD15_UNET_VALUES = 859_520_964  # the SD 1.5 UNet's weights


def test_sd15_lora_with_offload_plans_each_phase_at_real_size():
    """Over 10 s: two weightless SD 1.5 models at real size (the RAM plan's and the GPU
    plan's); the tiny model has no real-size phases to check."""
    config = apply_overrides(load_config(REPO / "training_presets/sd15/lora_6gb.json"),
                             [DATA, "model.offload_blocks=10"])
    folder = REPO / "modules/models/configs/sd15"
    plan = plan_ram(config, folder, torch.device("cuda"))
    phases = {p.name: dict(p.lines) for p in plan.phases}
    # loading: every component at its load dtype (bf16), all on the CPU at once
    assert phases["loading"]["unet weights as loaded (bf16, 859,520,964 values)"] \
        == SD15_UNET_VALUES * 2
    assert plan.peak.name == "loading" and 1.5 * GIB < plan.peak.total < 2.5 * GIB
    # caching (both caches on): the larger cached component, the text encoder, is the one on
    # the device
    loaded = {w.split(" ")[0]: size for w, size in phases["loading"].items()}
    [away] = [w for w in phases["caching"] if "on the device while its outputs" in w]
    assert away.startswith("text_encoder weights") and phases["caching"][away] == 0
    assert loaded["text_encoder"] > loaded["vae"]
    # training: the cached components stay on the CPU, and the offloaded blocks in pinned RAM,
    # as many bytes as the GPU plan says they take off the card
    training = phases["training"]
    [blocks] = [size for what, size in training.items() if what.startswith("10 offloaded")]
    gpu = dict(plan_memory(config, folder).lines)
    [offload] = [what for what in gpu if "blocks offloaded to CPU memory" in what]
    assert f"({gib(blocks)} of weights" in offload
    assert {w.split(" ")[0] for w in training} >= {"text_encoder", "vae"}
    assert "peak: " in plan.describe()[-1]


def test_a_run_over_the_machines_ram_is_refused_with_the_fix(tempera_cache, tmp_path):
    """The tiny SD 1.5 in float32, on a machine given less RAM than its loading peak but more
    than the bf16 one: refused before anything loads, naming the peak and the fix."""
    config = make_config(tempera_cache, tmp_path / "out")
    folder = ensure_builtin_model(config.model.path, tempera_cache)
    device = torch.device("cpu")
    fp32 = plan_ram(config, folder, device).peak
    bf16 = plan_ram(apply_overrides(config, ["model.weight_dtype=BFLOAT16"]), folder, device).peak
    assert bf16.total < fp32.total
    ram = (bf16.total + fp32.total) // 2
    with pytest.raises(ConfigError) as caught:
        memory_check.check_memory(config, folder, device, ram=ram)
    message = str(caught.value)
    assert f"fits this machine's {gib(ram)} of RAM" in message
    assert f"a peak of at least {gib(fp32.total)} while {fp32.name}" in message
    assert (f"--set model.weight_dtype=BFLOAT16 makes the peak {gib(bf16.total)} (fits)"
            in message)
    # with enough RAM the run passes, and the check carries the plan for run.json
    check = memory_check.check_memory(config, folder, device, ram=fp32.total)
    assert check.ram is not None and check.record()["ram"]["peak_bytes"] == fp32.total
    assert any(line.startswith("RAM plan (this machine has") for line in check.describe())


def test_klein_9b_loads_its_text_encoder_first_and_peaks_at_the_larger_phase():
    """The 9B LoRA preset for 16 GB at real size (weightless): with its captions cached, Qwen3-8B
    loads alone and is released before the transformer (train/setup/text_first.py), so the
    loading peak is the larger of the two loads, not their sum (31.16 GiB); with the cache off
    the whole model loads at once, and the plan says why."""
    config = apply_overrides(load_config(REPO / "training_presets/klein/lora_9b_16gb.json"),
                             [DATA])
    folder = REPO / "modules/models/configs/klein9b"
    plan = plan_ram(config, folder, torch.device("cuda"))
    phases = {p.name: p for p in plan.phases}
    assert list(phases) == ["loading the text encoder", "loading", "caching", "training"]
    # the caption rows the cache holds (at most RESIDENT_ROW_BYTES) from the first phase on:
    # it caches them there (tests/train/test_text_rows.py)
    [(encoder, encoder_bytes), (rows, rows_bytes)] = phases["loading the text encoder"].lines
    assert encoder.startswith("text_encoder weights as loaded (bf16, 7,568,405,632 values")
    assert rows.startswith("caption rows in memory") and rows_bytes == RESIDENT_ROW_BYTES
    later = [what for name in ("loading", "caching", "training")
             for what, _ in phases[name].lines]
    assert not any(what.startswith("text_encoder") for what in later), later
    assert plan.peak.name == "loading" and plan.peak.total < 17.5 * GIB  # 17.13 GiB
    assert plan.peak.total == max(p.total for p in plan.phases)
    assert "loaded first and alone" in plan.record()["text_encoder_order"]
    together = plan_ram(apply_overrides(config, ["data.cache_text_encoder_outputs=false"]),
                        folder, torch.device("cuda"))
    assert [p.name for p in together.phases] == ["loading", "caching", "training"]
    # loaded together, before any caption is cached: no rows in memory yet
    assert together.peak.total == plan.peak.total + encoder_bytes - rows_bytes  # 31.16 GiB
    assert together.peak.total > 31 * GIB
    assert ("text encoder: loaded with the rest (its outputs are not cached "
            "(data.cache_text_encoder_outputs is off))") in together.describe()


def test_the_caching_line_says_adapters_only_where_the_run_adds_them(tempera_cache, tmp_path):
    """The tiny SD 1.5: a LoRA run's UNet line while caching counts its adapters; a full
    fine-tune adds none (its trained weights are the UNet's own), and its line does not say so."""
    config = make_config(tempera_cache, tmp_path / "out")
    folder = ensure_builtin_model(config.model.path, tempera_cache)
    device = torch.device("cuda")

    def caching(method: str) -> list[str]:
        plan = plan_ram(apply_overrides(config, [f"training.method={method}"]), folder, device)
        return [what for what, _ in {p.name: p for p in plan.phases}["caching"].lines]
    assert any(w.startswith("unet weights and adapters") for w in caching("LORA"))
    lines = caching("FINE_TUNE")
    assert any(w.startswith("unet weights") for w in lines)
    assert not any("adapters" in w for w in lines), lines
