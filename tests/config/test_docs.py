"""docs/config.md is generated from the schema and is kept current."""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from modules.config import Config, apply_overrides
from modules.config import docs
from modules.config.docs import (
    DOC_PATH,
    SET_SYNTAX,
    render_config_reference,
    update_config_reference,
)
from modules.config.fields import setting
from modules.config.introspect import KINDS, field_map, iter_fields
from modules.config.schema import DatasetConfig

ROOT = Path(__file__).resolve().parents[2]
FIELDS = field_map(Config)


def test_committed_reference_is_current():
    committed = (ROOT / DOC_PATH).read_text(encoding="utf-8")
    assert committed == render_config_reference(), (
        f"{DOC_PATH} is out of date; run: python scripts/gen_config_docs.py")


def test_reference_lists_every_field_with_its_default():
    text = render_config_reference()
    for info in iter_fields(Config):
        row = next((line for line in text.splitlines()
                    if line.startswith(f"| `{info.dotted_path}` |")), None)
        assert row is not None, info.dotted_path
        assert info.help.replace("<", "&lt;").replace(">", "&gt;") in row
    assert "| `data.datasets[].repeats` | integer | `1` | 1 to 10,000 |" in text
    assert "| `components.denoiser.train` | boolean | `true` |" in text
    assert "| `compile.backend` | enum | `\"NONE\"` | `NONE`, `DEFAULT`" in text


def test_reference_explains_builtins_paths_and_set():
    text = render_config_reference()
    assert "python scripts/gen_config_docs.py" in text.split("\n\n")[1]
    for expected in ("`builtin:tiny-sd15`", "`builtin:shapes`",
                     "relative to **the folder of that config file**",
                     "relative to **the current folder**", "`data.datasets.0.repeats=3`"):
        assert expected in text


@dataclass
class _Extra:
    knob: int = setting(3, label="Knob", group="Advanced", min=0, max=9, help="A knob.")


@dataclass
class _ConfigWithExtra(Config):
    extra: _Extra = setting(default_factory=_Extra, label="Extra", group="Advanced",
                            help="More.")


def test_a_new_field_shows_up_without_editing_the_generator(monkeypatch):
    monkeypatch.setattr(docs, "Config", _ConfigWithExtra)
    text = docs.render_config_reference()
    assert "## `extra`: Extra\n\nMore." in text
    assert "| `extra.knob` | integer | `3` | 0 to 9 | Advanced tab: Knob | A knob. |" in text


def _kind_of_key(key: str) -> str:
    """The kind of the field a --set key names ("data.datasets.0.path" -> "path")."""
    normalized = re.sub(r"\[\d+\]|\.\d+(?=\.|$)", "[]", key)
    if normalized in FIELDS:
        return FIELDS[normalized].kind
    return next(i.kind for i in iter_fields(DatasetConfig, "data.datasets[]")
                if i.dotted_path == normalized)


@pytest.mark.parametrize("kind", KINDS)
def test_every_set_example_in_the_reference_works(kind, tmp_path):
    _, examples = SET_SYNTAX[kind]
    assert examples
    for example in examples:
        key = example.partition("=")[0]
        # The list-of-objects row also shows how to set one item's field by index.
        item_example = kind == "list_dataclass" and re.search(r"\[\d+\]|\.\d+\.", key)
        assert item_example or _kind_of_key(key) == kind, example
    apply_overrides(Config(), examples, cwd=tmp_path)  # raises ConfigError if one is wrong


def test_update_writes_then_reports_current(tmp_path):
    path = tmp_path / "config.md"
    assert update_config_reference(path, check=True) is False
    assert not path.exists()
    assert update_config_reference(path) is False
    assert path.read_text(encoding="utf-8") == render_config_reference()
    assert update_config_reference(path, check=True) is True


def test_script_check_exits_0_when_current():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_config_docs.py"),
                             "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
