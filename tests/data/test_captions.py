"""Caption rules (trigger words, shuffled and dropped tags, kohya's keep separator), captions
from a metadata file, and what they do to training: exact per (seed, epoch, item), and never
cached as text encoder outputs when they change."""
from __future__ import annotations

import json
import random

import pytest
from PIL import Image

from modules.config import Config, apply_overrides
from modules.data.captions import (CaptionRules, CaptionsFileError, item_caption,
                                   load_captions_file, transform_caption)
from modules.data.dataset import ImageCaptionDataset
from modules.data.folders import DatasetSource, scan_datasets
from modules.train.setup.inputs import check_inputs

TAGS = "1girl, red hair, smile, outdoors, tree, sky"


def test_no_rules_leave_a_caption_exactly_as_written():
    assert transform_caption(" a photo,  of a cat ", CaptionRules(), random.Random(0)) == \
        " a photo,  of a cat "


def test_prefix_suffix_and_kept_tags_stay_in_place_while_the_rest_shuffle():
    rules = CaptionRules(prefix="sks", suffix="masterpiece", shuffle_tags=True, keep_tags=2)
    seen = set()
    for seed in range(20):
        tags = transform_caption(TAGS, rules, random.Random(seed)).split(", ")
        assert tags[:3] == ["sks", "1girl", "red hair"] and tags[-1] == "masterpiece"
        assert sorted(tags[3:-1]) == sorted(["smile", "outdoors", "tree", "sky"])
        seen.add(tuple(tags))
    assert len(seen) > 5  # really shuffled


def test_the_keep_separator_keeps_what_comes_before_it():
    rules = CaptionRules(shuffle_tags=True, keep_tags=5)  # the separator wins over keep_tags
    for seed in range(10):
        tags = transform_caption("a photo of sks dog ||| sitting, grass, sun", rules,
                                 random.Random(seed)).split(", ")
        assert tags[0] == "a photo of sks dog" and sorted(tags[1:]) == ["grass", "sitting", "sun"]
    # without any rule the separator is still not trained as text
    assert transform_caption("sks dog ||| grass", CaptionRules(), random.Random(0)) == \
        "sks dog, grass"


def test_tag_dropout_drops_about_its_share_and_never_a_kept_tag():
    rules = CaptionRules(keep_tags=1, tag_dropout=0.5)
    kept = [len(transform_caption(TAGS, rules, random.Random(s)).split(", ")) - 1
            for s in range(400)]
    assert all(transform_caption(TAGS, rules, random.Random(s)).startswith("1girl")
               for s in range(50))
    assert 2.0 < sum(kept) / len(kept) < 3.0  # 5 droppable tags, half kept on average


def test_an_items_caption_depends_only_on_seed_epoch_and_item():
    rules = (CaptionRules(), CaptionRules(shuffle_tags=True))
    first = item_caption(TAGS, 1, rules, seed=3, epoch=2, index=7)
    assert first == item_caption(TAGS, 1, rules, seed=3, epoch=2, index=7) and first[1]
    others = {item_caption(TAGS, 1, rules, seed=3, epoch=e, index=7)[0] for e in range(8)}
    assert len(others) > 1  # another epoch, another order
    assert item_caption(TAGS, 0, rules, 3, 2, 7) == (TAGS, False)  # source 0 has no rules


def _images(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        Image.new("RGB", (64, 64), "red").save(folder / name)
    return folder


def test_captions_from_a_metadata_file_win_over_txt_files(tmp_path):
    folder = _images(tmp_path / "data", ["a.png", "b.png", "c.png"])
    (folder / "b.txt").write_text("from the txt file", encoding="utf-8")
    (folder / "c.txt").write_text("c from txt", encoding="utf-8")
    jsonl = tmp_path / "metadata.jsonl"
    jsonl.write_text(json.dumps({"file_name": "a.png", "text": "a from jsonl"}) + "\n"
                     + json.dumps({"file_name": "b.png", "caption": "b from jsonl"}) + "\n",
                     encoding="utf-8")
    scan = scan_datasets([DatasetSource(folder, 1, load_captions_file(jsonl))])
    assert {p.path.name: p.caption for p in scan.items} == {
        "a.png": "a from jsonl", "b.png": "b from jsonl", "c.png": "c from txt"}
    as_json = tmp_path / "captions.json"
    as_json.write_text(json.dumps({"c.png": "c from json"}), encoding="utf-8")
    assert load_captions_file(as_json) == {"c.png": "c from json"}


@pytest.mark.parametrize("name, text, expected", [
    ("bad.jsonl", '{"file_name": "a.png", "text": "ok"}\n{"file_name": "b.png"}\n', "line 2"),
    ("bad.jsonl", "not json\n", "line 1: not valid JSON"),
    ("bad.json", '["a list"]', "expected one object"),
    ("missing.json", None, "cannot be read"),
])
def test_a_bad_captions_file_is_named_with_its_line(tmp_path, name, text, expected):
    path = tmp_path / name
    if text is not None:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(CaptionsFileError, match=expected):
        load_captions_file(path)
    config = apply_overrides(Config(), [f"data.datasets[0].captions_file={path}"])
    (problem,) = check_inputs(config)
    assert problem.path == "data.datasets[0].captions_file" and expected in str(problem)
    if text is not None:
        assert path.read_text(encoding="utf-8") == text  # left as it was


def test_the_dataset_applies_each_sources_rules(tmp_path):
    first = _images(tmp_path / "one", ["x.png"])
    second = _images(tmp_path / "two", ["y.png"])
    (first / "x.txt").write_text(TAGS, encoding="utf-8")
    (second / "y.txt").write_text(TAGS, encoding="utf-8")
    scan = scan_datasets([DatasetSource(first), DatasetSource(second)])
    dataset = ImageCaptionDataset(scan.items, resolution=64, seed=1, caption_rules=[
        CaptionRules(prefix="sks"), CaptionRules(shuffle_tags=True)])
    plain = dataset[(0, 0)]
    assert plain["caption"] == "sks, " + TAGS and plain["caption_varies"] is False
    shuffled = {dataset[(epoch, 1)]["caption"] for epoch in range(6)}
    assert len(shuffled) > 1 and all(dataset[(e, 1)]["caption_varies"] for e in range(2))


def test_training_with_varying_captions_resumes_exactly_and_does_not_cache_them(tiny_config,
                                                                               tmp_path):
    from modules.events import RecordingCallbacks
    from modules.train.trainer import train
    from tests.train.test_resume import run_json, stop_then_resume
    folder = _images(tmp_path / "tags", [f"{i}.png" for i in range(4)])
    for i in range(4):
        (folder / f"{i}.txt").write_text(f"shape{i}, red, circle, blue, background",
                                         encoding="utf-8")
    settings = (f"data.datasets[0].path={folder}", "data.datasets[0].shuffle_tags=true",
                "data.datasets[0].keep_tags=1", "data.datasets[0].tag_dropout=0.3",
                "data.datasets[0].caption_prefix=sks", "data.cache_text_encoder_outputs=true",
                "training.max_steps=6")
    events = RecordingCallbacks()
    train(tiny_config(*settings, f"output.dir={tmp_path / 'whole'}"), events)
    assert any("change their captions every epoch" in s and "not cached" in s
               for s in events.statuses)
    stop_then_resume(tiny_config(*settings, f"output.dir={tmp_path / 'parts'}"), at=3)
    assert run_json(tmp_path / "parts")["losses"] == run_json(tmp_path / "whole")["losses"]
