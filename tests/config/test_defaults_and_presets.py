"""The defaults and every shipped preset load and validate.

Top-level presets (the demo) run as they are. The per-model-type presets
(`training_presets/<type>/`) carry real settings and leave the base model and the dataset to
the user: those two, and only those two, are reported until they are set.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from modules.config import Config, load_config, validate
from modules.config.loader import to_dict
from modules.config.schema import DatasetConfig

PRESETS_DIR = Path(__file__).resolve().parents[2] / "training_presets"
PRESETS = sorted(PRESETS_DIR.glob("**/*.json"))
RUNNABLE = [p for p in PRESETS if p.parent == PRESETS_DIR]
TYPED = [p for p in PRESETS if p.parent != PRESETS_DIR]
USER_SUPPLIED = {"model.path", "data.datasets"}


def all_problems(config):
    """validate() and the checks of the inputs on disk, as a start runs them."""
    from modules.train.setup.inputs import check_inputs
    return validate(config) + check_inputs(config)


def _ids(paths):
    return [str(p.relative_to(PRESETS_DIR)) for p in paths]


def test_defaults_are_consistent():
    assert validate(Config()) == []


def test_defaults_are_valid_against_builtins_on_disk(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output folder "output" is relative
    assert all_problems(Config()) == []


def test_presets_folder_holds_presets():
    if not (PRESETS_DIR / "demo.json").exists():
        pytest.skip("training_presets/demo.json is not written yet (another engineer's task)")
    assert PRESETS, f"no preset found under {PRESETS_DIR}"


@pytest.mark.parametrize("preset", RUNNABLE, ids=_ids(RUNNABLE))
def test_preset_loads_and_validates(preset):
    config = load_config(preset)
    problems = all_problems(config)
    assert problems == [], "\n".join(str(p) for p in problems)


def test_every_model_type_has_a_lora_and_a_fine_tune_preset():
    from modules.model_types import MODEL_TYPES
    found = {(p.parent.name, load_config(p).model.type, load_config(p).training.method.value)
             for p in TYPED}
    for model_type in MODEL_TYPES:
        folder = model_type.value.lower()
        assert (folder, model_type, "LORA") in found
        assert (folder, model_type, "FINE_TUNE") in found


@pytest.mark.parametrize("preset", TYPED, ids=_ids(TYPED))
def test_typed_preset_asks_only_for_the_model_and_the_data(preset):
    from modules.model_types import MODEL_TYPES
    config = load_config(preset)
    problems = all_problems(config)
    assert {p.path for p in problems} == USER_SUPPLIED, "\n".join(str(p) for p in problems)
    assert "choose the base model" in next(p for p in problems if p.path == "model.path").message
    config.model.path = MODEL_TYPES[config.model.type].builtin
    config.data.datasets = [DatasetConfig(path="builtin:shapes")]
    assert all_problems(config) == []
    # a prompt added to any preset samples with a sampler its family's pipeline takes (the
    # Z-Image and Klein presets kept the config's DDIM, and a run with a prompt was refused)
    config.sampling.prompts = ["a red circle"]
    assert all_problems(config) == []
    assert config.output.dir == str((preset.parent / "../../output").resolve()
                                    / Path(config.output.dir).name)


@pytest.mark.parametrize("preset", PRESETS, ids=_ids(PRESETS))
def test_preset_paths_are_resolved_against_its_folder(preset):
    config = load_config(preset)
    for value in (config.model.path, config.output.dir, *(d.path for d in config.data.datasets)):
        assert value.startswith("builtin:") or Path(value).is_absolute() or value == "", value


def test_demo_preset_is_sparse_and_filled_with_defaults():
    demo = PRESETS_DIR / "demo.json"
    if not demo.exists():
        pytest.skip("training_presets/demo.json is not written yet (another engineer's task)")
    config = load_config(demo)
    defaults = to_dict(Config())
    # A key the demo leaves out takes its default.
    assert to_dict(config)["compile"] == defaults["compile"]
    # the demo writes into the user's data folder, never into the project folder
    from modules.paths import default_data_dir
    assert config.output.dir == str(default_data_dir() / "output" / "demo")
    assert not Path(config.output.dir).is_relative_to(PRESETS_DIR.parent)
