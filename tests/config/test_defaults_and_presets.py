"""The defaults and every shipped preset load and validate without a single problem."""
from __future__ import annotations

from pathlib import Path

import pytest

from modules.config import Config, load_config, validate
from modules.config.loader import to_dict

PRESETS_DIR = Path(__file__).resolve().parents[2] / "training_presets"
PRESETS = sorted(PRESETS_DIR.glob("**/*.json"))


def test_defaults_are_consistent():
    assert validate(Config(), check_files=False) == []


def test_defaults_are_valid_against_builtins_on_disk(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output folder "output" is relative
    assert validate(Config(), check_files=True) == []


def test_presets_folder_holds_presets():
    if not (PRESETS_DIR / "demo.json").exists():
        pytest.skip("training_presets/demo.json is not written yet (another engineer's task)")
    assert PRESETS, f"no preset found under {PRESETS_DIR}"


@pytest.mark.parametrize("preset", PRESETS, ids=[str(p.relative_to(PRESETS_DIR)) for p in PRESETS])
def test_preset_loads_and_validates(preset):
    config = load_config(preset)
    problems = validate(config, check_files=True)
    assert problems == [], "\n".join(str(p) for p in problems)


@pytest.mark.parametrize("preset", PRESETS, ids=[str(p.relative_to(PRESETS_DIR)) for p in PRESETS])
def test_preset_paths_are_resolved_against_its_folder(preset):
    config = load_config(preset)
    for value in (config.model.path, config.output.dir, *(d.path for d in config.data.datasets)):
        assert value.startswith("builtin:") or Path(value).is_absolute(), value


def test_demo_preset_is_sparse_and_filled_with_defaults():
    demo = PRESETS_DIR / "demo.json"
    if not demo.exists():
        pytest.skip("training_presets/demo.json is not written yet (another engineer's task)")
    config = load_config(demo)
    defaults = to_dict(Config())
    # A key the demo leaves out takes its default.
    assert to_dict(config)["compile"] == defaults["compile"]
    assert config.output.dir == str((PRESETS_DIR / "../output/demo").resolve())
