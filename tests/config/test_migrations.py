"""Ordered migrations: one test per step, plus version handling."""
from __future__ import annotations

import pytest

from modules.config import ConfigError, from_dict
from modules.config.migrations import MIGRATIONS, migrate
from modules.config.schema import CONFIG_VERSION, CompileBackend, CompileMode


def test_there_is_one_migration_per_schema_version():
    assert len(MIGRATIONS) == CONFIG_VERSION


def test_v0_to_v1_renames_compile_mode_to_backend():
    problems = []
    data = migrate({"config_version": 0, "compile": {"mode": "AOT_EAGER", "unet": True}},
                   problems)
    assert problems == []
    assert data == {"config_version": CONFIG_VERSION,
                    "compile": {"backend": "AOT_EAGER", "denoiser": True}}


def test_v0_to_v1_keeps_mode_when_backend_is_present():
    data = migrate({"config_version": 0,
                    "compile": {"backend": "INDUCTOR", "mode": "MAX_AUTOTUNE"}}, [])
    assert data["compile"] == {"backend": "INDUCTOR", "mode": "MAX_AUTOTUNE"}


def test_v0_to_v1_does_not_modify_its_input():
    original = {"compile": {"mode": "AOT_EAGER"}}
    migrate(original, [])
    assert original == {"compile": {"mode": "AOT_EAGER"}}


def test_v1_to_v2_names_the_denoiser_in_components_and_compile():
    old = {"config_version": 1, "components": {"unet": {"train": False, "learning_rate": 1e-5},
                                               "text_encoder": {"train": True}},
           "compile": {"backend": "AOT_EAGER", "unet": False}}
    data = migrate(old, [])
    assert data["components"] == {"denoiser": {"train": False, "learning_rate": 1e-5},
                                  "text_encoder": {"train": True}}
    assert data["compile"] == {"backend": "AOT_EAGER", "denoiser": False}
    assert "unet" in old["compile"]  # the input is left alone


def test_an_old_file_with_unet_keys_loads_as_the_same_config(tmp_path):
    import json

    from modules.config import load_config
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps({"config_version": 1,
                               "components": {"unet": {"train": False},
                                              "text_encoder": {"train": True}},
                               "compile": {"unet": False, "vae": True}}))
    new.write_text(json.dumps({"config_version": CONFIG_VERSION,
                               "components": {"denoiser": {"train": False},
                                              "text_encoder": {"train": True}},
                               "compile": {"denoiser": False, "vae": True}}))
    assert load_config(old) == load_config(new)
    assert load_config(old).components.denoiser.train is False


def test_file_without_version_is_v0_and_gets_migrated():
    config = from_dict({"compile": {"mode": "aot_eager"}})
    assert config.compile.backend == CompileBackend.AOT_EAGER
    assert config.compile.mode == CompileMode.DEFAULT
    assert config.config_version == CONFIG_VERSION


def test_current_version_is_not_migrated_again():
    config = from_dict({"config_version": CONFIG_VERSION, "compile": {"mode": "MAX_AUTOTUNE"}})
    assert config.compile.mode == CompileMode.MAX_AUTOTUNE
    assert config.compile.backend == CompileBackend.NONE


def test_version_from_the_future_is_rejected_with_other_problems():
    with pytest.raises(ConfigError) as info:
        from_dict({"config_version": CONFIG_VERSION + 1, "training": {"max_steps": -1}})
    problems = {p.path: p for p in info.value.problems}
    assert problems["config_version"].expected == f"at most {CONFIG_VERSION}"
    assert problems["config_version"].given == str(CONFIG_VERSION + 1)
    assert "newer Tempera" in problems["config_version"].message
    assert "training.max_steps" in problems


@pytest.mark.parametrize("version, given", [("1", '"1"'), (1.0, "1.0"), (True, "true"),
                                            (-1, "-1"), (None, "null")])
def test_version_of_a_wrong_type_is_rejected(version, given):
    with pytest.raises(ConfigError) as info:
        from_dict({"config_version": version})
    (problem,) = info.value.problems
    assert problem.path == "config_version"
    assert problem.expected == f"an integer from 0 to {CONFIG_VERSION}"
    assert problem.given == given
