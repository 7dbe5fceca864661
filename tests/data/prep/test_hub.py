"""Finding a preparation model's weights (modules/data/prep/hub.py), without any download."""
from __future__ import annotations


import pytest

from modules.data.prep.hub import download_bar, download_line, model_folder
from modules.data.prep.job import JobRefused

from tests.data.prep.tiny_captioners import put_in_cache


def test_a_cached_repository_is_found_without_a_network(tmp_path):
    snapshot = put_in_cache(tmp_path, "someone/tiny-captioner", {"config.json": "{}"})
    said: list[str] = []
    found = model_folder("someone/tiny-captioner", said.append, offline=True, cache_dir=tmp_path)
    assert found == snapshot and (found / "config.json").read_text() == "{}" and not said


def test_a_local_folder_is_used_as_it_is(tmp_path):
    assert model_folder(str(tmp_path), print) == tmp_path


@pytest.mark.parametrize("via_env", [False, True])
def test_offline_and_not_cached_is_refused_with_what_to_do(tmp_path, monkeypatch, via_env):
    from huggingface_hub import constants
    if via_env:  # HF_HUB_OFFLINE=1 is read by huggingface_hub when it is imported
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(JobRefused) as err:
        model_folder("someone/not-here", print, offline=not via_env, cache_dir=tmp_path)
    text = str(err.value)
    assert "someone/not-here is not in the Hugging Face cache" in text and str(tmp_path) in text
    assert "hf download someone/not-here" in text
    assert ("HF_HUB_OFFLINE is set" if via_env else "--offline") in text


@pytest.mark.parametrize("name", ["no-slash", "a/b/c", "/not/a/folder"])
def test_a_name_that_is_neither_folder_nor_repository_is_refused(name):
    with pytest.raises(JobRefused, match="neither a folder nor a Hugging Face repository"):
        model_folder(name, print)


def test_download_progress_goes_to_the_status_line():
    said: list[str] = []
    bar = download_bar("someone/model", said.append)(total=460e6, unit="B")
    bar.update(120e6)
    assert said == ["downloading someone/model: 120 MB of 460 MB"]
    assert download_line("x/y", 3, 7, "files") == "downloading x/y: 3 of 7 files"
