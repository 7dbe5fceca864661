"""data.resolutions (several resolutions in one run): the list field, its validation and the
resolutions each dataset trains at."""
from __future__ import annotations

from pathlib import Path

import pytest

from modules.config import Config, apply_overrides, from_dict, to_dict, validate
from modules.config.data import shapes_vary, source_resolutions, trained_resolutions
from modules.config.introspect import field_map


def config_with(*assignments: str) -> Config:
    return apply_overrides(Config(), list(assignments), cwd=Path("/nonexistent"))


def problems_of(config: Config) -> dict[str, str]:
    return {p.path: p.detail() for p in validate(config)}


def test_the_list_is_read_from_the_command_line_and_round_trips_through_json():
    config = config_with("data.resolutions=512, 768,1024")
    assert config.data.resolutions == [512, 768, 1024]
    assert from_dict(to_dict(config)).data.resolutions == [512, 768, 1024]
    assert config_with("data.resolutions=[]").data.resolutions == []
    assert field_map(Config)["data.resolutions"].kind == "list_int"
    assert validate(config) == []


def test_a_value_that_is_not_a_number_names_its_item():
    try:
        config_with("data.resolutions=512,big")
    except Exception as exc:  # ConfigError: the loader's problem list
        assert "data.resolutions[1]" in str(exc) and "integer" in str(exc)
    else:
        raise AssertionError("a non-number resolution was accepted")


@pytest.mark.parametrize("values, index, expected, fix", [
    ("512,500", 1, "a multiple of 64", "try 512"),
    ("512,8192", 1, "a side length between 64 and 4096", "try 4096"),
    ("32,512", 0, "a side length between 64 and 4096", "try 64"),
    ("512,768,512", 2, "a resolution not listed before", "already data.resolutions[0]"),
], ids=["not-a-multiple-of-64", "too-large", "too-small", "listed-twice"])
def test_each_bad_value_is_its_own_problem_with_the_fix(values, index, expected, fix):
    problems = problems_of(config_with(f"data.resolutions={values}"))
    detail = problems[f"data.resolutions[{index}]"]
    assert f"expected {expected}" in detail and fix in detail
    assert [p for p in problems if p.startswith("data.resolutions")] == [
        f"data.resolutions[{index}]"]  # the good values are not reported


def test_every_bad_value_is_reported_at_once():
    problems = problems_of(config_with("data.resolutions=512,500,8192,512,32"))
    assert sorted(p for p in problems if p.startswith("data.resolutions")) == [
        f"data.resolutions[{i}]" for i in (1, 2, 3, 4)]


def test_the_resolution_samples_use_must_be_listed():
    problems = problems_of(config_with("data.resolutions=768,1024"))  # data.resolution 512
    assert "one of data.resolutions (768, 1024)" in problems["data.resolution"]
    assert "samples and validation use data.resolution" in problems["data.resolution"]
    assert "data.resolution" not in problems_of(config_with("data.resolutions=512,1024"))


def test_a_datasets_own_list_is_validated_under_its_path():
    config = config_with('data.datasets=[{"path": "builtin:shapes"}, '
                         '{"path": "builtin:shapes", "resolutions": [1024, 100]}]')
    problems = problems_of(config)
    assert list(k for k in problems if k.startswith("data.datasets")) == [
        "data.datasets[1].resolutions[1]"]
    assert "a multiple of 64" in problems["data.datasets[1].resolutions[1]"]


def test_which_resolutions_each_dataset_trains_at():
    single = Config()
    assert source_resolutions(single.data) == [[512]] and not shapes_vary(single.data)
    config = config_with("data.resolutions=512,768",
                         'data.datasets=[{"path": "a"}, {"path": "b", "resolutions": [1024]}]')
    assert source_resolutions(config.data) == [[512, 768], [1024]]
    assert trained_resolutions(config.data) == [512, 768, 1024] and shapes_vary(config.data)


def test_buckets_only_need_to_be_possible_at_the_largest_resolution():
    # 64 px allows only the square bucket; with 192 px listed too, bucketing does something
    ok = config_with("data.resolution=64", "data.resolutions=64,192", "data.aspect_buckets=true",
                     "data.bucket_max_aspect=2.0")
    assert "data.aspect_buckets" not in problems_of(ok)
    alone = config_with("data.resolution=64", "data.aspect_buckets=true")
    assert "data.aspect_buckets" in problems_of(alone)
