"""Saving and loading round-trips, and how relative paths are resolved."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from modules.config import (
    Config,
    from_dict,
    load_config,
    relativize_paths,
    resolve_paths,
    save_config,
    sparse_dict,
    to_dict,
)
from modules.config.schema import CONFIG_VERSION, SaveFormat


def _custom_config(tmp_path: Path) -> Config:
    return from_dict({
        "model": {"path": str(tmp_path / "model"), "type": "SDXL"},
        "data": {"datasets": [{"path": str(tmp_path / "a"), "repeats": 3},
                              {"path": "builtin:shapes"}], "resolution": 1024},
        "training": {"learning_rate": 3e-5, "lora_target_modules": ["to_q"]},
        "components": {"text_encoder_2": {"train": True, "learning_rate": 1e-6}},
        "output": {"dir": str(tmp_path / "out"), "formats": ["DIFFUSERS", "KOHYA"]},
        "sampling": {"prompts": []},
    })


@pytest.mark.parametrize("sparse", [False, True])
def test_load_save_load_gives_an_equal_config(tmp_path, sparse):
    first = tmp_path / "first.json"
    save_config(_custom_config(tmp_path), first, sparse=sparse)
    loaded = load_config(first)
    second = tmp_path / "second.json"
    save_config(loaded, second, sparse=sparse)
    assert load_config(second) == loaded
    assert loaded == _custom_config(tmp_path)


def test_full_save_writes_every_field_and_enums_as_names(tmp_path):
    path = tmp_path / "full.json"
    save_config(Config(), path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data == to_dict(Config())
    assert data["output"]["formats"] == ["DIFFUSERS"]


def test_sparse_save_of_defaults_has_only_the_version(tmp_path):
    path = tmp_path / "sparse.json"
    save_config(Config(), path, sparse=True)
    assert json.loads(path.read_text(encoding="utf-8")) == {"config_version": CONFIG_VERSION}


def test_sparse_dict_keeps_only_changed_keys():
    config = Config()
    config.training.max_steps = 5
    config.output.formats = [SaveFormat.KOHYA]
    assert sparse_dict(config) == {"training": {"max_steps": 5},
                                   "output": {"formats": ["KOHYA"]},
                                   "config_version": CONFIG_VERSION}


def test_sparse_file_loads_with_defaults_filled_in(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"training": {"max_steps": 9}}), encoding="utf-8")
    expected = resolve_paths(Config(), tmp_path)
    expected.training.max_steps = 9
    assert load_config(path) == expected


# --- paths -------------------------------------------------------------------------------------

def test_relative_paths_resolve_against_the_config_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "c.json").write_text(json.dumps(
        {"data": {"datasets": [{"path": "images"}]}, "output": {"dir": "../runs/one"}}),
        encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # must not matter
    config = load_config(Path("project") / "c.json")
    assert config.data.datasets[0].path == str(folder.resolve() / "images")
    assert config.output.dir == str((tmp_path / "runs" / "one").resolve())


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "c.json").write_text(json.dumps({"model": {"path": "~/models/sd"}}),
                                     encoding="utf-8")
    assert load_config(tmp_path / "c.json").model.path == str(tmp_path / "home/models/sd")


def test_data_placeholder_is_the_users_data_folder(tmp_path, monkeypatch):
    import sys
    if sys.platform in ("win32", "darwin"):
        pytest.skip("the XDG data folder is Linux's")
    from modules.config import apply_overrides
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "share"))
    (tmp_path / "c.json").write_text(json.dumps({"output": {"dir": "{data}/output/demo"}}),
                                     encoding="utf-8")
    assert load_config(tmp_path / "c.json").output.dir == str(tmp_path / "share/tempera/output/demo")
    config = apply_overrides(Config(), ["output.dir={data}/mine"])
    assert config.output.dir == str(tmp_path / "share/tempera/mine")
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load_config(tmp_path / "c.json").output.dir == str(
        tmp_path / "home/.local/share/tempera/output/demo")


def test_builtin_and_empty_values_are_untouched(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(
        {"model": {"path": "builtin:tiny-sd15"}, "general": {"cache_dir": ""}}),
        encoding="utf-8")
    config = load_config(tmp_path / "c.json")
    assert config.model.path == "builtin:tiny-sd15"
    assert config.data.datasets[0].path == "builtin:shapes"
    assert config.general.cache_dir == ""
    assert config.compile.cache_dir == ""


def test_absolute_paths_are_kept(tmp_path):
    elsewhere = tmp_path / "elsewhere" / "images"
    (tmp_path / "c.json").write_text(json.dumps({"data": {"datasets": [{"path": str(elsewhere)}]}}),
                                     encoding="utf-8")
    assert load_config(tmp_path / "c.json").data.datasets[0].path == str(elsewhere)


def test_resolve_paths_returns_a_copy():
    config = Config()
    resolved = resolve_paths(config, Path("/base"))
    assert resolved.output.dir == str(Path("/base/output").resolve())
    assert config.output.dir == "output"


def test_relativize_keeps_outside_paths_absolute_and_makes_inside_ones_relative(tmp_path):
    base = tmp_path / "preset"
    outside = tmp_path / "data" / "images"
    config = from_dict({"data": {"datasets": [{"path": str(base / "images")},
                                              {"path": str(outside)},
                                              {"path": "builtin:shapes"}]},
                        "output": {"dir": str(base)}})
    relative = relativize_paths(config, base)
    assert [d.path for d in relative.data.datasets] == ["images", str(outside), "builtin:shapes"]
    assert relative.output.dir == "."
    assert config.data.datasets[0].path == str(base / "images")  # the input is not changed


def test_relativized_preset_resolves_inside_its_copy(tmp_path):
    project = tmp_path / "project"
    (project / "images").mkdir(parents=True)
    config = resolve_paths(from_dict({"data": {"datasets": [{"path": "images"}]},
                                      "output": {"dir": "runs"}}), project)
    save_config(relativize_paths(config, project), project / "preset.json", sparse=True)
    saved = json.loads((project / "preset.json").read_text(encoding="utf-8"))
    assert saved["data"]["datasets"][0]["path"] == "images"

    copy = tmp_path / "moved" / "project-copy"
    shutil.copytree(project, copy)
    moved = load_config(copy / "preset.json")
    assert moved.data.datasets[0].path == str(copy.resolve() / "images")
    assert moved.output.dir == str(copy.resolve() / "runs")
