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
    assert [i.dotted_path for i in items] == ["data.datasets[].path", "data.datasets[].repeats"]


def test_container_labels():
    labels = container_labels(Config)
    assert labels["components.denoiser"] == "UNet"
    assert labels["compile"] == "Model compilation"
