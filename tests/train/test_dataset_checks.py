"""What a dataset scan finds that would train nothing (issue 44), refused before anything is
written (`check_run`, the CLI's --check and every start): a captions file that names no image
of its folder, and loss masks that keep no pixel; less than all of either is a warning."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from modules.config.problems import ConfigError
from modules.events import RecordingCallbacks
from modules.train.setup.prepare import check_run


def images(folder: Path, names: list[str], masks: dict[str, int] | None = None) -> Path:
    """64 px images named `names`; `masks` gives some a `<stem>_mask.png` of one grey level."""
    folder.mkdir(parents=True)
    for i, name in enumerate(names):
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(folder / name)
    for name, level in (masks or {}).items():
        Image.new("L", (64, 64), level).save(folder / f"{Path(name).stem}_mask.png")
    return folder


def test_a_captions_file_that_names_no_image_is_refused_naming_both(tiny_config, tmp_path):
    folder = images(tmp_path / "cats", ["a.png", "b.png"])
    captions = tmp_path / "captions.json"
    captions.write_text(json.dumps({"img_001.png": "a cat", "img_002.png": "a dog"}))
    config = tiny_config(f"data.datasets[0].path={folder}",
                         f"data.datasets[0].captions_file={captions}")
    with pytest.raises(ConfigError) as err:
        check_run(config, RecordingCallbacks())
    (problem,) = err.value.problems
    assert problem.path == "data.datasets[0].captions_file"
    assert "none of its 2 names is an image there" in problem.message
    assert "img_001.png" in problem.message and "a.png" in problem.message
    assert not Path(config.output.dir).exists()  # nothing written

    captions.write_text(json.dumps({"a.png": "a cat", "img_002.png": "a dog"}))
    callbacks = RecordingCallbacks()
    check_run(config, callbacks)  # some names match: the run may go on, with a warning
    assert any("1 of the 2 names" in s and "img_002.png" in s for s in callbacks.statuses)


def test_masks_that_keep_no_pixel_are_refused_when_all_and_warned_when_some(tiny_config,
                                                                            tmp_path):
    inverted = images(tmp_path / "inverted", ["a.png", "b.png"], masks={"a.png": 0, "b.png": 0})
    config = tiny_config(f"data.datasets[0].path={inverted}", "data.masked_loss=true")
    with pytest.raises(ConfigError) as err:
        check_run(config, RecordingCallbacks())
    (problem,) = err.value.problems
    assert problem.path == "data.masked_loss" and "inverted" in problem.message
    assert "loss would be exactly 0" in problem.message

    some = images(tmp_path / "some", ["a.png", "b.png"], masks={"a.png": 0, "b.png": 255})
    callbacks = RecordingCallbacks()
    check_run(tiny_config(f"data.datasets[0].path={some}", "data.masked_loss=true"), callbacks)
    assert any("1 image(s) have a mask that keeps no pixel" in s and "a.png" in s
               for s in callbacks.statuses)
