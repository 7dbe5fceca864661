"""The per-model-type presets train as shipped, on the tiny model of their type.

Only what a user supplies (model, data) and what makes it fit a CPU test (size, steps, no
compile: compiled training is tested in test_compiled_training.py) is overridden; EMA, bf16,
buckets, latent and text-encoder caching, min-SNR and the save formats run as shipped.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from modules.config import apply_overrides, load_config
from modules.model_types import MODEL_TYPES
from modules.train.trainer import train

PRESETS_DIR = Path(__file__).resolve().parents[2] / "training_presets"
TYPED = sorted(p for p in PRESETS_DIR.glob("*/*.json"))
# What each method writes per save format (a family without kohya or single-file layouts,
# Klein, ships presets with the diffusers format alone).
EXPECTED_FILES = {("LORA", "DIFFUSERS"): {"pytorch_lora_weights.safetensors"},
                  ("LORA", "KOHYA"): {"lora_kohya.safetensors"},
                  ("FINE_TUNE", "DIFFUSERS"): {"model_index.json"},
                  ("FINE_TUNE", "SINGLE_FILE"): {"model.safetensors"},
                  ("TEXTUAL_INVERSION", "DIFFUSERS"): {"learned_embeds.safetensors"},
                  ("TEXTUAL_INVERSION", "KOHYA"): {"my-concept.safetensors"}}


@pytest.mark.parametrize("preset", TYPED, ids=[f"{p.parent.name}/{p.stem}" for p in TYPED])
def test_typed_preset_trains_on_the_tiny_model_of_its_type(preset, tempera_cache, tmp_path):
    shipped = load_config(preset)
    config = apply_overrides(shipped, [
        f"model.path={MODEL_TYPES[shipped.model.type].builtin}",
        'data.datasets=[{"path": "builtin:shapes"}]', "data.resolution=256", "data.workers=0",
        f"general.cache_dir={tempera_cache}", f"output.dir={tmp_path / 'out'}",
        "training.max_steps=2", "training.gradient_accumulation=1", "training.batch_size=2",
        "training.lr_warmup_steps=0",  # the presets' warm-ups are longer than these 2 steps
        "compile.backend=NONE", "logging.tensorboard=false", "output.save_every_steps=0"])
    result = train(config)
    assert result.status == "finished" and result.steps == 2
    files = {p.name for p in (result.output_dir / "final").iterdir()}
    expected = set().union(*(EXPECTED_FILES.get((shipped.training.method.value, f.value), set())
                             for f in shipped.output.formats))
    assert expected and expected <= files, (expected, files)
