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
    assert data == {"config_version": 1, "compile": {"backend": "AOT_EAGER", "unet": True}}


def test_v0_to_v1_keeps_mode_when_backend_is_present():
    data = migrate({"config_version": 0,
                    "compile": {"backend": "INDUCTOR", "mode": "MAX_AUTOTUNE"}}, [])
    assert data["compile"] == {"backend": "INDUCTOR", "mode": "MAX_AUTOTUNE"}


def test_v0_to_v1_does_not_modify_its_input():
    original = {"compile": {"mode": "AOT_EAGER"}}
    migrate(original, [])
    assert original == {"compile": {"mode": "AOT_EAGER"}}


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
