"""Strict loading: every bad value is reported with its dotted path, expectation and value."""
from __future__ import annotations

import json

import pytest

from modules.config import Config, ConfigError, from_dict, load_config
from modules.config.schema import CONFIG_VERSION, CompileBackend, SaveFormat


def problems_of(data) -> dict:
    """dotted path -> Problem for every problem `from_dict` reports (it must report some)."""
    with pytest.raises(ConfigError) as info:
        from_dict(data)
    by_path = {p.path: p for p in info.value.problems}
    assert len(by_path) == len(info.value.problems), "one problem per path expected"
    return by_path


def test_sparse_data_fills_in_defaults():
    config = from_dict({"training": {"max_steps": 7}})
    assert config.training.max_steps == 7
    expected = Config()
    expected.training.max_steps = 7
    assert config == expected


def test_unknown_top_level_key_suggests_the_close_one():
    problem = problems_of({"modle": {}})["modle"]
    assert "unknown key 'modle'" in problem.given
    assert "did you mean 'model'?" in problem.message
    assert "model" in problem.expected


def test_unknown_nested_key_suggests_the_close_one():
    problem = problems_of({"training": {"learning_rte": 0.1}})["training.learning_rte"]
    assert "did you mean 'learning_rate'?" in str(problem)


def test_unknown_key_far_from_any_gives_no_suggestion():
    problem = problems_of({"training": {"zzzzzz": 1}})["training.zzzzzz"]
    assert problem.message == ""



@pytest.mark.parametrize("data, path", [
    ({"logging": {"wandb_api_key": "0123456789abcdef" * 2 + "01234567"}}, "logging.wandb_api_key"),
    ({"logging": {"wandb_api_key": ""}}, "logging.wandb_api_key"),   # unknown, not refused
    ({"model": {"hub_token": "hf_x"}}, "model.hub_token"),
])
def test_a_secret_entry_is_refused_once_and_no_field_is_suggested_for_it(data, path):
    """Issue 54: the refused W&B key entry was listed again as an unknown key, "did you mean
    'wandb_entity'?": an invitation to paste the key into a field the config keeps."""
    problem = problems_of(data)[path]         # one problem per path (problems_of checks it)
    assert "did you mean" not in str(problem)

@pytest.mark.parametrize("data, path, expected, given", [
    ({"training": {"max_steps": True}}, "training.max_steps", "an integer", "true"),
    ({"training": {"max_steps": 1.5}}, "training.max_steps", "an integer", "1.5"),
    ({"training": {"learning_rate": "1e-4"}}, "training.learning_rate", "a number", '"1e-4"'),
    ({"training": {"learning_rate": False}}, "training.learning_rate", "a number", "false"),
    ({"data": {"center_crop": 1}}, "data.center_crop", "true or false", "1"),
    ({"data": {"center_crop": "yes"}}, "data.center_crop", "true or false", '"yes"'),
    ({"sampling": {"prompts": {"a": 1}}}, "sampling.prompts", "a list of strings", '{"a": 1}'),
    ({"sampling": {"prompts": "a cat"}}, "sampling.prompts", "a list of strings", '"a cat"'),
    ({"data": {"datasets": {"path": "x"}}}, "data.datasets", "a list of objects",
     '{"path": "x"}'),
    ({"model": "builtin:tiny-sd15"}, "model", "an object", '"builtin:tiny-sd15"'),
    ({"model": {"path": 3}}, "model.path", "a string", "3"),
    ({"data": {"resolution": None}}, "data.resolution", "an integer", "null"),
    ({"components": {"denoiser": {"learning_rate": "fast"}}}, "components.denoiser.learning_rate",
     "a number or null", '"fast"'),
])
def test_wrong_types_are_rejected(data, path, expected, given):
    problem = problems_of(data)[path]
    assert problem.expected == expected
    assert problem.given == given


def test_whole_floats_are_accepted_as_integers_and_ints_as_floats():
    config = from_dict({"training": {"max_steps": 10.0, "learning_rate": 1}})
    assert config.training.max_steps == 10 and isinstance(config.training.max_steps, int)
    assert config.training.learning_rate == 1.0 and isinstance(config.training.learning_rate,
                                                               float)


def test_optional_float_accepts_null_and_a_number():
    config = from_dict({"components": {"denoiser": {"learning_rate": None},
                                       "text_encoder": {"learning_rate": 5e-5}}})
    assert config.components.denoiser.learning_rate is None
    assert config.components.text_encoder.learning_rate == 5e-5


@pytest.mark.parametrize("data, path, expected", [
    ({"training": {"max_steps": -1}}, "training.max_steps", "a value between 0 and 100000000"),
    ({"training": {"learning_rate": 2.0}}, "training.learning_rate", "a value between 0 and 1"),
    ({"training": {"learning_rate": -1e-5}}, "training.learning_rate",
     "a value between 0 and 1"),
    ({"data": {"resolution": 32}}, "data.resolution", "a value between 64 and 4096"),
    ({"components": {"vae": {"learning_rate": 3}}}, "components.vae.learning_rate",
     "a value between 0 and 1"),
])
def test_out_of_range_numbers_are_rejected(data, path, expected):
    assert problems_of(data)[path].expected == expected


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_are_rejected(value):
    # NaN slips through every `<`/`>` range comparison, so it needs its own check.
    problem = problems_of({"training": {"learning_rate": value}})["training.learning_rate"]
    assert problem.expected == "a finite number"


def test_enum_values_are_case_insensitive():
    config = from_dict({"compile": {"backend": "aot_eager"}, "output": {"formats": ["kohya"]}})
    assert config.compile.backend == CompileBackend.AOT_EAGER
    assert config.output.formats == [SaveFormat.KOHYA]


def test_unknown_enum_value_lists_the_allowed_ones():
    problem = problems_of({"compile": {"backend": "tvm"}})["compile.backend"]
    assert problem.expected == "one of NONE, DEFAULT, INDUCTOR, TRITON, AOT_EAGER"
    assert problem.given == '"tvm"'


def test_bad_list_items_are_named_by_index():
    problems = problems_of({
        "data": {"datasets": [{"path": "a"}, {"path": "b", "repeats": 0},
                              {"path": "c", "repeats": "two"}]},
        "output": {"formats": ["DIFFUSERS", "ONNX"]},
        "sampling": {"prompts": ["ok", 3]},
    })
    assert problems["data.datasets[1].repeats"].expected == "a value between 1 and 10000"
    assert problems["data.datasets[2].repeats"].given == '"two"'
    assert problems["output.formats[1]"].given == '"ONNX"'
    assert problems["sampling.prompts[1]"].expected == "a string"
    assert "data.datasets[0].path" not in problems


def test_unknown_key_inside_a_list_item():
    problem = problems_of({"data": {"datasets": [{"path": "a", "repeat": 2}]}})[
        "data.datasets[0].repeat"]
    assert "did you mean 'repeats'?" in problem.message


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        from_dict({"modle": {}, "training": {"max_steps": "many", "learning_rate": 9},
                   "compile": {"backend": "tvm"}, "data": {"datasets": [{"repeats": -2}]}})
    paths = [p.path for p in info.value.problems]
    assert sorted(paths) == sorted(["modle", "training.max_steps", "training.learning_rate",
                                    "compile.backend", "data.datasets[0].repeats"])
    text = str(info.value)
    assert "5 problem(s)" in text
    assert all(f"  - {p}" in text for p in paths)


def test_problem_text_reads_path_expected_given_and_hint():
    problem = problems_of({"trainig": {}})["trainig"]
    assert str(problem).startswith("trainig: expected a known key (")
    assert str(problem).endswith("got unknown key 'trainig' (did you mean 'training'?)")


def test_top_level_must_be_an_object():
    problem = problems_of([1, 2])["(top level)"]
    assert problem.expected == "a JSON object"


def test_long_values_are_shortened_in_messages():
    problem = problems_of({"training": {"max_steps": "x" * 200}})["training.max_steps"]
    assert len(problem.given) <= 60 and problem.given.endswith("...")


# --- files -------------------------------------------------------------------------------------

def test_invalid_json_names_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "training": {\n    "max_steps": 10,\n  }\n}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.expected == "valid JSON"
    assert "line 4 column 3" in problem.given
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.expected == "an existing config file"
    assert problem.given == str(path)


def test_non_utf8_file(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"sampling": {"prompts": ["café"]}}'.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.expected == "a readable UTF-8 file"
    assert str(path) in problem.given


def test_a_folder_instead_of_a_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert info.value.problems[0].path == "(file)"


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"training": {"max_steps": 3}}).encode())
    assert load_config(path).training.max_steps == 3


def test_file_problems_name_the_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"training": {"max_steps": -3}}), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path} has 1 problem(s)")


def test_loaded_config_has_current_version(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{}", encoding="utf-8")
    assert load_config(path).config_version == CONFIG_VERSION
