"""The per-model-type presets train as shipped, on the tiny model of their type.

Only what a user supplies (model, data) and what makes it fit a CPU test (size, steps, no
compile: compiled training is tested in test_compiled_training.py) is overridden; EMA, bf16,
buckets, latent and text-encoder caching, min-SNR and the save formats run as shipped.
Presets that differ only in what is overridden here (a batch size, a warm-up) or in their
description (the card they name) are the same run here: it is trained once for all of them,
and the test's id names every preset it stands for.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from modules.config import Config, apply_overrides, load_config, to_dict
from modules.model_types import MODEL_TYPES
from modules.train.trainer import train
from tests.train.test_bucketed_training import SQUARE, make_images

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


def run_config_of(preset: Path, data: Path, cache: Path, output: Path) -> Config:
    """The shipped preset with what the test supplies: the tiny model of its type, 4 images
    at 192 px (the smallest resolution with aspect buckets), 2 steps of
    batch 2, no compile."""
    shipped = load_config(preset)
    return apply_overrides(shipped, [
        f"model.path={MODEL_TYPES[shipped.model.type].builtin}",
        f'data.datasets=[{{"path": "{data}"}}]', "data.resolution=192", "data.workers=0",
        f"general.cache_dir={cache}", f"output.dir={output}",
        "training.max_steps=2", "training.gradient_accumulation=1", "training.batch_size=2",
        "training.lr_warmup_steps=0",  # the presets' warm-ups are longer than these 2 steps
        "compile.backend=NONE", "logging.tensorboard=false", "output.save_every_steps=0"])


def same_run_groups() -> list[list[Path]]:
    """The presets grouped by the run this test makes of them (the whole config tree but the
    description): each group is trained once."""
    groups: dict[str, list[Path]] = {}
    for preset in TYPED:
        tree = to_dict(run_config_of(preset, Path("data"), Path("cache"), Path("out")))
        tree["general"].pop("description")
        groups.setdefault(repr(tree), []).append(preset)
    return list(groups.values())


GROUPS = same_run_groups()



@pytest.fixture(scope="module")
def four_images(tmp_path_factory) -> Path:
    return make_images(tmp_path_factory.mktemp("presets") / "data", [SQUARE] * 4)


@pytest.mark.parametrize("group", GROUPS, ids=["+".join(f"{p.parent.name}/{p.stem}" for p in g)
                                               for g in GROUPS])
def test_typed_preset_trains_on_the_tiny_model_of_its_type(group, four_images, tempera_cache,
                                                            tmp_path):
    shipped = load_config(group[0])
    result = train(run_config_of(group[0], four_images, tempera_cache, tmp_path / "out"))
    assert result.status == "finished" and result.steps == 2
    files = {p.name for p in (result.output_dir / "final").iterdir()}
    expected = set().union(*(EXPECTED_FILES.get((shipped.training.method.value, f.value), set())
                             for f in shipped.output.formats))
    assert expected and expected <= files, (expected, files)
