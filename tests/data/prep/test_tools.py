"""The preparation tools' table, which the Data tab builds its windows from: every setting has
its help, what a user types is read as the setting's type (or refused naming the setting),
every preset is a valid job, and the mask form turns into the mask job's settings and runs."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image

from tests.data.prep.tiny_mask_models import build_tiny_background
from modules.data.prep.tools import parse_setting, prep_actions, prep_tool, setting_text

TOOLS = tuple(prep_actions())


def test_the_tools_are_offered_by_their_buttons_and_each_setting_has_its_help():
    assert prep_actions() == {"caption": "Caption images…", "mask": "Make masks…"}
    for key in TOOLS:
        tool = prep_tool(key)
        assert tool.key == key and tool.presets
        for f in dataclasses.fields(tool.settings_type):
            assert f.metadata.get("help"), f"{key}: {f.name} has no help for its tooltip"
            assert str(f.type) in ("str", "int", "float", "bool", "tuple[str, ...]"), f.type


@pytest.mark.parametrize("key", TOOLS)
def test_every_preset_is_a_job_the_engine_accepts(key):
    tool = prep_tool(key)
    for name in tool.presets:
        settings = tool.preset(name)
        # what the window shows, typed back, is the same settings
        shown = {f.name: (v if isinstance(v := getattr(settings, f.name), bool)
                          else setting_text(v)) for f in dataclasses.fields(settings)}
        assert tool.settings(shown) == settings
    if key == "mask":
        assert all(tool.preset(n).settings().problems() == [] for n in tool.presets)
    else:
        from modules.data.prep.caption import validate
        assert all(validate(tool.preset(n)) == [] for n in tool.presets)


def test_what_a_user_types_is_read_as_the_settings_type_or_refused_by_name():
    fields = {f.name: f for f in dataclasses.fields(prep_tool("mask").settings_type)}
    assert parse_setting(fields["dilate"], " -4 ") == -4
    assert parse_setting(fields["blur"], "1.5") == 1.5
    assert parse_setting(fields["prompts"], "person, the dog,, ") == ("person", "the dog")
    assert parse_setting(fields["invert"], True) is True
    assert parse_setting(fields["invert"], "no") is False
    for name, typed, message in (("dilate", "two", "Dilate: 'two' is not a whole number"),
                                 ("blur", "soft", "Blur: 'soft' is not a number"),
                                 ("segmenter", "sam", "Segmenter: 'sam' is not one of clipseg"),
                                 ("invert", "maybe", "Invert: 'maybe' is neither yes nor no")):
        with pytest.raises(ValueError, match=message):
            parse_setting(fields[name], typed)
    with pytest.raises(ValueError, match="no such setting: colour"):
        prep_tool("mask").settings({"colour": "red"})


def test_the_mask_form_becomes_the_jobs_settings_and_runs_through_the_table(tmp_path):
    tool = prep_tool("mask")
    form = tool.settings({"segmenter": "background", "model": "u2net", "soft": True,
                          "model_file": "", "device": "auto", "dilate": "2"})
    settings = form.settings()
    assert settings.shape.threshold is None and settings.model_file is None
    assert settings.device is None and settings.shape.dilate == 2
    folder = tmp_path / "images"
    folder.mkdir()
    picture = Image.new("RGB", (40, 24), (0, 0, 255))
    picture.paste((255, 0, 0), (6, 6, 12, 12))
    picture.save(folder / "img.png")
    onnx_file = build_tiny_background(tmp_path / "model")
    form = tool.settings({"segmenter": "background", "model": "u2net",
                          "model_file": str(onnx_file), "offline": True})
    report = tool.run(folder, form, tool.hooks(), __import__("threading").Event())
    assert report.status == "finished" and [p.name for p in report.written] == ["img_mask.png"]
    mask = np.asarray(Image.open(folder / "img_mask.png")) > 127
    assert mask[7:11, 7:11].all() and not mask[:, 20:].any()
    with pytest.raises(tool.refused, match="prompts: CLIPSeg needs at least one prompt"):
        tool.run(folder, tool.settings({"segmenter": "clipseg"}), tool.hooks(), None)
