"""The Z-Image presets against the memory plan at the real model's size: the plan is built on
the meta device from the shipped configs (modules/models/configs/zimage: the 6 B transformer,
Qwen3-4B, the Flux VAE), so nothing is loaded and no weights are needed (the first plan
of a process pays for importing the model classes, over 10 s on a loaded CPU; that the encoder
is counted only while it stays is test_text_store.py's, on the tiny model)."""
from __future__ import annotations

from pathlib import Path


from modules.config.loader import load_config
from modules.config.overrides import apply_overrides
from modules.config.schema import CompileBackend, CompileScope, SaveFormat, TrainingMethod
from modules.train.memory.memory_plan import GIB, plan_memory

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "modules" / "models" / "configs" / "zimage"
DATA = 'data.datasets=[{"path": "builtin:shapes"}]'


def _plan(preset: str, *overrides: str):
    config = apply_overrides(load_config(REPO / "training_presets" / "zimage" / preset),
                             [DATA, *overrides])
    return config, plan_memory(config, SHIPPED)


def test_the_lora_preset_is_for_a_24_gb_card_at_1024_px():
    """bf16, gradient checkpointing, REGIONAL DEFAULT (inductor) on the transformer; the plan
    (weights, adapters, optimizer state) leaves a 24 GB card about 10 GiB for activations, because the
    4 B text encoder is on the card only while the captions are cached."""
    config, plan = _plan("lora.json")
    assert config.training.method == TrainingMethod.LORA and config.data.resolution == 1024
    assert config.training.gradient_checkpointing and config.data.cache_text_encoder_outputs
    assert (config.compile.backend, config.compile.scope) == (CompileBackend.DEFAULT,
                                                               CompileScope.REGIONAL)
    assert {SaveFormat.DIFFUSERS, SaveFormat.KOHYA} <= set(config.output.formats)
    encoder = [size for what, size in plan.lines if what.startswith("text_encoder")]
    assert encoder == [0]
    assert 11 * GIB < plan.total < 14 * GIB, plan.describe()


def test_the_full_fine_tune_preset_fits_an_80_gb_card_by_the_plan():
    """The transformer's bf16 weights, gradients and AdamW's two states (about 46 GiB) leave
    an 80 GB card over 25 GiB for activations at 1024 px with checkpointing."""
    config, plan = _plan("fine_tune.json")
    assert config.training.method == TrainingMethod.FINE_TUNE
    assert config.training.gradient_checkpointing
    assert set(config.output.formats) == {SaveFormat.DIFFUSERS, SaveFormat.SINGLE_FILE}
    assert 40 * GIB < plan.total < 50 * GIB, plan.describe()
