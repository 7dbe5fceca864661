"""`--set dotted.key=value`: every field type, list indexes, and all bad assignments at once."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from modules.config import Config, ConfigError, apply_overrides, load_config
from modules.config.schema import CompileBackend, SaveFormat


def set_(*assignments: str, config: Config | None = None, cwd: Path | None = None) -> Config:
    return apply_overrides(config or Config(), list(assignments), cwd=cwd or Path("/cwd"))


def problems_of(*assignments: str) -> dict:
    with pytest.raises(ConfigError) as info:
        set_(*assignments)
    assert str(info.value).startswith("--set has")
    return {p.path: p for p in info.value.problems}


@pytest.mark.parametrize("text, value", [
    ("true", True), ("True", True), ("1", True), ("yes", True), ("ON", True),
    ("false", False), ("FALSE", False), ("0", False), ("no", False), ("off", False),
])
def test_bool_spellings(text, value):
    assert set_(f"compile.denoiser={text}").compile.denoiser is value
    assert set_(f"data.center_crop={text}").data.center_crop is value


def test_bad_bool_is_rejected():
    problem = problems_of("compile.denoiser=maybe")["compile.denoiser"]
    assert (problem.expected, problem.given) == ("true or false", '"maybe"')


def test_int():
    assert set_("training.max_steps=200").training.max_steps == 200


@pytest.mark.parametrize("text", ["abc", "true", "1.5"])
def test_bad_int_is_rejected(text):
    assert problems_of(f"training.max_steps={text}")["training.max_steps"].expected == \
        "an integer"


def test_int_out_of_range_is_rejected():
    problem = problems_of("training.batch_size=0")["training.batch_size"]
    assert problem.expected == "a value between 1 and 4096"


@pytest.mark.parametrize("text, value", [("1e-4", 1e-4), ("0.5", 0.5), ("1", 1.0)])
def test_float(text, value):
    result = set_(f"training.learning_rate={text}").training.learning_rate
    assert result == value and isinstance(result, float)


def test_bad_float_is_rejected():
    problem = problems_of("training.learning_rate=fast")["training.learning_rate"]
    assert (problem.expected, problem.given) == ("a number", '"fast"')


@pytest.mark.parametrize("text", ["aot_eager", "AOT_EAGER", "Aot_Eager", " aot_eager "])
def test_enum_is_case_insensitive(text):
    assert set_(f"compile.backend={text}").compile.backend == CompileBackend.AOT_EAGER


def test_unknown_enum_value_is_rejected():
    problem = problems_of("compile.backend=tvm")["compile.backend"]
    assert problem.expected.startswith("one of NONE, DEFAULT")


@pytest.mark.parametrize("text, value", [
    ("to_q,to_v", ["to_q", "to_v"]),
    (" to_q , to_v ", ["to_q", "to_v"]),
    ('["to_q", "to_out.0"]', ["to_q", "to_out.0"]),
    ("to_q", ["to_q"]),
    ("", []),
    ("[]", []),
])
def test_list_of_str(text, value):
    assert set_(f"training.lora_target_modules={text}").training.lora_target_modules == value


def test_list_of_str_json_keeps_commas_inside_items():
    prompts = set_('sampling.prompts=["a cat, sitting", "a dog"]').sampling.prompts
    assert prompts == ["a cat, sitting", "a dog"]


@pytest.mark.parametrize("text", ["diffusers,kohya", '["DIFFUSERS", "kohya"]'])
def test_list_of_enums(text):
    assert set_(f"output.formats={text}").output.formats == [SaveFormat.DIFFUSERS,
                                                             SaveFormat.KOHYA]


def test_bad_item_in_list_of_enums_is_named_by_index():
    problem = problems_of("output.formats=diffusers,onnx")["output.formats[1]"]
    assert problem.given == '"onnx"'


@pytest.mark.parametrize("text", ["none", "None", "null", "NULL", ""])
def test_optional_float_none(text):
    config = Config()
    config.components.denoiser.learning_rate = 1e-5
    result = set_(f"components.denoiser.learning_rate={text}", config=config)
    assert result.components.denoiser.learning_rate is None


def test_optional_float_number():
    assert set_("components.denoiser.learning_rate=5e-5").components.denoiser.learning_rate == 5e-5


def test_optional_float_bad_value():
    problem = problems_of("components.denoiser.learning_rate=fast")["components.denoiser.learning_rate"]
    assert problem.expected == "a number or null"


@pytest.mark.parametrize("key", ["data.datasets[0].repeats", "data.datasets.0.repeats"])
def test_list_index_paths(key):
    assert set_(f"{key}=3").data.datasets[0].repeats == 3


def test_second_list_item_after_replacing_the_list():
    config = set_('data.datasets=[{"path": "builtin:shapes"}, {"path": "builtin:shapes"}]',
                  "data.datasets[1].repeats=4")
    assert [d.repeats for d in config.data.datasets] == [1, 4]


def test_item_of_a_plain_list_by_index():
    assert set_("output.formats[0]=kohya").output.formats == [SaveFormat.KOHYA]


def test_bad_value_at_an_index_is_named_by_index():
    problem = problems_of("data.datasets[0].repeats=0")["data.datasets[0].repeats"]
    assert problem.expected == "a value between 1 and 10000"


@pytest.mark.parametrize("key", ["data.datasets[5].repeats", "data.datasets.5.repeats"])
def test_out_of_range_index(key):
    problem = problems_of(f"{key}=3")[key]
    assert "index 5 is out of range; data.datasets has 1 item(s)" in problem.message


def test_indexing_a_value_an_earlier_set_replaced():
    problems = problems_of("data.datasets=[1]", "data.datasets[0].repeats=2")
    assert "data.datasets[0] is not an object" in problems["data.datasets[0].repeats"].message
    assert problems["data.datasets[0]"].expected == "an object"


def test_unknown_key_suggests_the_close_one():
    problem = problems_of("training.max_step=3")["training.max_step"]
    assert problem.expected == "dotted.key=value naming a config field"
    assert problem.given == "'training.max_step=3'"
    assert problem.message == "did you mean 'training.max_steps'?"



def test_a_secret_key_is_neither_suggested_a_field_nor_echoed():
    """Issue 54: `--set logging.wandb_api_key=KEY` suggested 'logging.wandb_entity' (where the
    key would be kept) and repeated the key in the message."""
    problem = problems_of("logging.wandb_api_key=abc123secret")["logging.wandb_api_key"]
    assert "did you mean" not in problem.message
    assert "abc123secret" not in str(problem)

def test_unknown_key_inside_list_item():
    problem = problems_of("data.datasets[0].repeat=3")["data.datasets[0].repeat"]
    assert "did you mean 'data.datasets[0].repeats'?" in problem.message


@pytest.mark.parametrize("assignment, path", [
    ("=3", "=3"),
    ("training..max_steps=3", "training..max_steps"),
    ("training.max_steps[0]=3", "training.max_steps[0]"),
    ("0=1", "0"),
])
def test_malformed_keys_are_rejected(assignment, path):
    problem = problems_of(assignment)[path]
    assert problem.expected == "dotted.key=value naming a config field"
    assert problem.given == repr(assignment)


def test_a_section_needs_an_object():
    problem = problems_of("training=3x")["training"]
    assert (problem.expected, problem.given) == ("an object", '"3x"')


def test_assignment_without_equals_says_so():
    problem = problems_of("training.max_steps")["training.max_steps"]
    assert problem.expected == "dotted.key=value"
    assert problem.message == "no '=' in it"


def test_bad_json_is_reported_with_its_position():
    problem = problems_of('sampling.prompts=["a cat", ')["sampling.prompts"]
    assert problem.expected == "valid JSON"
    assert "column" in problem.message


def test_several_bad_sets_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        set_("training.max_step=3", "compile.backend=tvm", "data.datasets[3].path=x",
             "sampling.prompts=[", "training.learning_rate=2", "compile.denoiser=true")
    paths = [p.path for p in info.value.problems]
    assert sorted(paths) == sorted(["training.max_step", "compile.backend",
                                    "data.datasets[3].path", "sampling.prompts",
                                    "training.learning_rate"])
    assert "5 problem(s)" in str(info.value)


def test_value_may_contain_equals_signs():
    assert set_("sampling.prompts=a=b").sampling.prompts == ["a=b"]


def test_later_set_wins():
    assert set_("training.max_steps=1", "training.max_steps=2").training.max_steps == 2


def test_input_config_is_not_changed():
    config = Config()
    set_("training.max_steps=9", config=config)
    assert config.training.max_steps == 0


# --- paths -------------------------------------------------------------------------------------

def test_set_paths_resolve_against_cwd(tmp_path):
    config = set_("data.datasets[0].path=images", "model.path=../m", "output.dir=/abs/out",
                  cwd=tmp_path / "here")
    assert config.data.datasets[0].path == str((tmp_path / "here" / "images").resolve())
    assert config.model.path == str((tmp_path / "m").resolve())
    assert config.output.dir == "/abs/out"


def test_set_paths_inside_json_resolve_against_cwd(tmp_path):
    config = set_('data.datasets=[{"path": "images"}, {"path": "builtin:shapes"}]', cwd=tmp_path)
    assert [d.path for d in config.data.datasets] == [str(tmp_path.resolve() / "images"),
                                                      "builtin:shapes"]


def test_set_builtin_paths_are_untouched(tmp_path):
    assert set_("model.path=builtin:tiny-sdxl", cwd=tmp_path).model.path == "builtin:tiny-sdxl"


def test_set_paths_default_to_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = apply_overrides(Config(), ["output.dir=runs"])
    assert config.output.dir == str(tmp_path.resolve() / "runs")


def test_unset_relative_paths_are_not_resolved_by_set(tmp_path):
    config = set_("training.max_steps=3", cwd=tmp_path)
    assert config.output.dir == "output"


def test_file_paths_use_the_file_folder_and_set_paths_the_cwd(tmp_path):
    preset_dir = tmp_path / "presets"
    preset_dir.mkdir()
    (preset_dir / "p.json").write_text(json.dumps(
        {"data": {"datasets": [{"path": "images"}, {"path": "more"}]}}), encoding="utf-8")
    config = apply_overrides(load_config(preset_dir / "p.json"),
                             ["data.datasets[1].path=mine"], cwd=tmp_path / "work")
    assert config.data.datasets[0].path == str(preset_dir.resolve() / "images")
    assert config.data.datasets[1].path == str((tmp_path / "work" / "mine").resolve())


def test_keys_renamed_by_a_migration_are_still_accepted():
    """`compile.unet` and `components.unet.*` (config version 1) set the denoiser's fields."""
    config = set_("compile.unet=false", "components.unet.learning_rate=5e-5")
    assert config.compile.denoiser is False
    assert config.components.denoiser.learning_rate == 5e-5
