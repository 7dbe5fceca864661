"""`iter_fields`: the one walk over the schema that the docs and the GUI share."""
from __future__ import annotations

import dataclasses
import typing

from modules.config import Config
from modules.config.introspect import KINDS, container_labels, field_map, iter_fields
from modules.config.schema import CompileBackend, DatasetConfig, SaveFormat


def _leaf_count(cls) -> int:
    count = 0
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        count += _leaf_count(tp) if dataclasses.is_dataclass(tp) else 1
    return count


def test_every_leaf_field_is_visited_once():
    paths = [info.dotted_path for info in iter_fields(Config)]
    assert len(paths) == len(set(paths)) == _leaf_count(Config)


def test_kinds_of_representative_fields():
    fields = field_map(Config)
    expected = {
        "data.center_crop": "bool", "training.max_steps": "int",
        "training.learning_rate": "float", "data.caption_extension": "str",
        "compile.backend": "enum", "model.path": "path", "output.dir": "path",
        "training.lora_target_modules": "list_str", "output.formats": "list_enum",
        "data.resolutions": "list_int",
        "components.denoiser.learning_rate": "optional_float", "data.datasets": "list_dataclass",
    }
    assert {path: fields[path].kind for path in expected} == expected
    assert {info.kind for info in iter_fields(Config)} == set(KINDS)


def test_defaults_come_from_the_default_instance():
    fields = field_map(Config)
    assert fields["components.denoiser.train"].default is True  # ComponentConfig.train is False
    assert fields["components.vae.train"].default is False
    assert fields["data.datasets"].default == [DatasetConfig()]
    assert fields["output.formats"].default == [SaveFormat.DIFFUSERS]


def test_metadata_and_helpers():
    info = field_map(Config)["compile.backend"]
    assert info.label == "Backend" and info.group == "Advanced" and info.help
    assert info.enum_type is CompileBackend
    assert (info.name, info.parent) == ("backend", "compile")
    assert field_map(Config)["output.formats"].enum_type is SaveFormat
    assert field_map(Config)["data.datasets"].item_type is DatasetConfig
    assert field_map(Config)["training.seed"].metadata["max"] == 2**32 - 1


def test_list_item_fields_with_a_prefix():
    items = list(iter_fields(DatasetConfig, "data.datasets[]"))
    assert [i.dotted_path for i in items][:2] == ["data.datasets[].path",
                                                  "data.datasets[].repeats"]
    assert all(i.dotted_path.startswith("data.datasets[].") for i in items)
    assert "data.datasets[].captions_file" in [i.dotted_path for i in items]


def test_container_labels():
    labels = container_labels(Config)
    assert labels["components.denoiser"] == "UNet"
    assert labels["compile"] == "Model compilation"


# --- on_resume / compile_check metadata: declared on a section or a field, read by rule_at ----
def test_a_section_rule_holds_for_its_fields_and_a_field_rule_is_the_exception():
    from modules.config.fields import OnResume
    from modules.config.introspect import on_resume
    assert on_resume("model.path") is OnResume.MUST_MATCH           # from the section
    assert on_resume("model.allow_pickle") is OnResume.MAY_CHANGE   # the field's exception
    assert on_resume("components.denoiser.train") is OnResume.MUST_MATCH
    assert on_resume("components.denoiser.learning_rate") is OnResume.MAY_CHANGE
    assert on_resume("training.lora_rank") is OnResume.MUST_MATCH    # declared on the field
    assert on_resume("training.learning_rate") is OnResume.MAY_CHANGE  # declared nowhere
    assert on_resume("general.cache_dir") is OnResume.IGNORED
    # A list item's field is looked up through the list's item type, and a key of another
    # schema version keeps the rule of the section it was under.
    assert on_resume("data.datasets[0].path") is OnResume.MUST_MATCH
    assert on_resume("model.some_old_key") is OnResume.MUST_MATCH
    assert on_resume("no_such_section.x") is OnResume.MAY_CHANGE


def test_compile_check_dependencies_come_from_the_schema():
    from modules.config.introspect import outdates_compile_check
    assert outdates_compile_check("compile.scope")
    assert outdates_compile_check("training.gradient_checkpointing")
    assert outdates_compile_check("components.vae.train")
    assert not outdates_compile_check("training.learning_rate")
    assert not outdates_compile_check("sampling.prompts")
    assert not outdates_compile_check("data.datasets[0].path")


def test_a_resume_migrates_the_backups_config_and_refuses_one_from_the_future():
    from modules.config import Config, apply_overrides, to_dict
    from modules.train.state.backup import config_differences
    current = to_dict(Config())
    old = to_dict(Config())
    old.pop("config_version")
    old["compile"]["mode"] = old["compile"].pop("backend")  # version 0 named it compile.mode
    # Migrated, the backend is the same; version 0 had no torch.compile mode to compare.
    assert config_differences(old, current) == ([], ["compile.mode: None -> 'DEFAULT'"])
    future = {**current, "config_version": current["config_version"] + 1}
    blocking, _ = config_differences(future, current)
    assert blocking and "newer Tempera" in blocking[0]
    changed = to_dict(apply_overrides(Config(), ["training.lora_rank=8", "data.workers=2",
                                                 "output.dir=elsewhere"]))
    blocking, allowed = config_differences(current, changed)
    assert blocking == ["training.lora_rank: 16 -> 8"]
    assert allowed == ["data.workers: 0 -> 2"]


def test_rule_at_resolves_each_sections_type_hints_once(monkeypatch):
    from modules.config.fields import OnResume
    from modules.config.introspect import on_resume, rule_at
    for path in ("data.datasets[0].path", "validation.every_steps"):  # warm the cache
        on_resume(path)
    calls = []
    real = typing.get_type_hints
    monkeypatch.setattr(typing, "get_type_hints", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert on_resume("data.datasets[3].repeats") == OnResume.MUST_MATCH
    assert on_resume("validation.every_steps") == OnResume.MAY_CHANGE
    assert rule_at(Config, "validation.split_ratio", "on_resume") == OnResume.MUST_MATCH
    assert calls == []
