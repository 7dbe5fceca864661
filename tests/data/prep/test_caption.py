"""Captioning a folder (modules/data/prep/caption.py) with tiny random-weight Florence-2,
Qwen3-VL and WD-tagger models built here (tests/data/prep/tiny_captioners.py): files written,
existing captions kept as the user chose, the model released, the tags right."""
from __future__ import annotations

import dataclasses
import gc
import os
import threading
import weakref
from pathlib import Path

import pytest
from PIL import Image

from modules.data.prep.caption import (BACKUP_FOLDER, CaptionSettings, caption_folder,
                                       preset_settings, read_caption, validate)
from modules.data.prep.job import LOCK_NAME, JobHooks, JobRefused, journal_name

from tests.data.prep.tiny_captioners import (build_tiny_florence2, build_tiny_qwen_vl,
                                             build_tiny_wd_tagger, put_in_cache)

pytest.importorskip("onnxruntime", reason="the `data` extra (onnxruntime) runs the WD taggers")

RED, GREEN, GREY = (230, 20, 20), (20, 230, 20), (128, 128, 128)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("captioners")
    return {"florence2": build_tiny_florence2(root / "florence2"),
            "qwen-vl": build_tiny_qwen_vl(root / "qwen-vl"),
            "wd-tagger": build_tiny_wd_tagger(root / "wd-tagger")}


def settings(models, captioner: str, **changes) -> CaptionSettings:
    values = {"model": str(models[captioner]), "device": "cpu", "offline": True, **changes}
    return preset_settings(None, captioner=captioner, **values)


def dataset(root: Path, colours=(RED, GREEN, GREY), size=(24, 24)) -> Path:
    folder = root / "data"
    folder.mkdir(parents=True)
    for i, colour in enumerate(colours):
        Image.new("RGB", size, colour).save(folder / f"img{i}.png")
    return folder


@pytest.fixture
def loaded_models(monkeypatch) -> list[weakref.ref]:
    """Weak references to every model a caption job loads (the table's rows wrapped)."""
    from modules.data.prep import caption
    refs: list[weakref.ref] = []

    def watched(kind):
        def make(folder, options):
            captioner = kind.make(folder, options)
            refs.append(weakref.ref(getattr(captioner, "model", captioner)))
            return captioner
        return dataclasses.replace(kind, make=make)

    monkeypatch.setattr(caption, "CAPTIONERS", {name: watched(kind)
                                                for name, kind in caption.CAPTIONERS.items()})
    return refs


def released(refs: list[weakref.ref]) -> bool:
    gc.collect()
    return bool(refs) and all(ref() is None for ref in refs)


def test_florence2_captions_every_image_and_is_released_after(models, tmp_path, loaded_models):
    """Over 10 s on a busy CPU only as the file's first test: its setup builds the three tiny
    models (transformers' Florence-2 and Qwen3-VL modules imported for the first time), and its
    first generate imports the generation code; the captioning itself takes about a second."""
    folder = dataset(tmp_path)
    (folder / "broken.png").write_bytes(b"")
    seen, said = [], []
    report = caption_folder(folder, settings(models, "florence2", prefix="sks", batch_size=2,
                                            max_tokens=8),
                            JobHooks(progress=seen.append, status=said.append))
    assert report.status == "finished" and [p.done for p in seen] == [1, 2, 3, 4], report.lines()
    for i in range(3):
        text = (folder / f"img{i}.txt").read_text(encoding="utf-8")
        assert text.startswith("sks, ") and len(text.strip()) > len("sks, ")
    assert [(p.name, r) for p, r in report.skipped] == [("broken.png", "empty file (0 bytes)")]
    assert not (folder / "broken.txt").exists() and not (folder / LOCK_NAME).exists()
    assert any("loading Florence-2" in s and "on the CPU" in s for s in said)
    assert released(loaded_models)  # the model is not held after the job


def test_qwen_vl_captions_a_batch_of_different_sizes(models, tmp_path, loaded_models):
    folder = dataset(tmp_path)
    Image.new("RGB", (64, 24), RED).save(folder / "wide.png")  # more image tokens: padding
    report = caption_folder(folder, settings(models, "qwen-vl", batch_size=4, max_tokens=6))
    assert report.status == "finished" and len(report.written) == 4 and not report.failed
    assert all(read_caption(path) for path in report.written)
    assert released(loaded_models)


def test_qwen_vl_reads_a_chat_template_kept_in_the_tokenizer(tmp_path):
    model = build_tiny_qwen_vl(tmp_path / "qwen", template_beside=False)
    folder = dataset(tmp_path, colours=(RED,))
    report = caption_folder(folder, preset_settings(None, captioner="qwen-vl", model=str(model),
                                                    device="cpu", max_tokens=5))
    assert report.status == "finished" and read_caption(folder / "img0.txt")


def test_the_tagger_writes_tags_over_their_thresholds_characters_first(models, tmp_path):
    folder = dataset(tmp_path)
    report = caption_folder(folder, settings(models, "wd-tagger", exclude_tags=("^_^",)))
    assert report.status == "finished"
    # the rating ("general") is never written; ^_^ is excluded; simple background scores 0.5
    assert read_caption(folder / "img0.txt") == ("hakurei reimu, red theme, 1girl, "
                                                 "simple background")
    assert read_caption(folder / "img1.txt") == ("hatsune miku, green theme, 1girl, "
                                                 "simple background")
    assert read_caption(folder / "img2.txt") == "1girl, simple background"


def test_a_tagger_of_one_image_at_a_time_runs_a_batch_image_by_image(tmp_path):
    model = build_tiny_wd_tagger(tmp_path / "one", batch=1)
    folder = dataset(tmp_path)
    report = caption_folder(folder, preset_settings(None, captioner="wd-tagger", model=str(model),
                                                    device="cpu", batch_size=3))
    assert report.status == "finished" and len(report.written) == 3
    assert read_caption(folder / "img1.txt").startswith("hatsune miku, green theme")


def test_tagger_thresholds_and_the_keep_separator(models, tmp_path):
    folder = dataset(tmp_path, colours=(GREEN,))
    caption_folder(folder, settings(models, "wd-tagger", general_threshold=0.6,
                                    character_threshold=0.99, keep_separator=True))
    # miku scores 0.998 at character 0.99; simple background's 0.5 is under 0.6
    assert read_caption(folder / "img0.txt") == "hatsune miku ||| green theme, 1girl, ^_^"
    again = dataset(tmp_path / "b", colours=(GREEN,))
    caption_folder(again, settings(models, "wd-tagger", character_threshold=0.999,
                                   keep_separator=True))
    assert read_caption(again / "img0.txt") == "green theme, 1girl, ^_^, simple background"


def test_existing_captions_are_skipped_by_default(models, tmp_path):
    folder = dataset(tmp_path)
    (folder / "img0.txt").write_bytes(b"my own words\r\n")
    (folder / "img1.txt").write_bytes(b"")  # empty: it has no caption yet
    report = caption_folder(folder, settings(models, "wd-tagger"))
    assert (folder / "img0.txt").read_bytes() == b"my own words\r\n"
    assert [(p.name, r) for p, r in report.left_alone] == [("img0.png", "has a caption (.txt)")]
    assert read_caption(folder / "img1.txt") and not (folder / BACKUP_FOLDER).exists()


def test_replace_keeps_the_old_file_byte_for_byte(models, tmp_path):
    folder = dataset(tmp_path, colours=(RED,))
    old = "the old caption, café".encode("cp1252")  # another encoding: kept as it was
    (folder / "img0.txt").write_bytes(old)
    caption_folder(folder, settings(models, "wd-tagger", existing="replace"))
    assert read_caption(folder / "img0.txt").startswith("hakurei reimu")
    backups = list((folder / BACKUP_FOLDER).rglob("img0.txt"))
    assert len(backups) == 1 and backups[0].read_bytes() == old
    # replaced again at once (the same second): the user's caption is still kept
    first = (folder / "img0.txt").read_bytes()
    caption_folder(folder, settings(models, "wd-tagger", existing="replace", prefix="again"))
    kept = sorted(p.read_bytes() for p in (folder / BACKUP_FOLDER).rglob("img0.txt"))
    assert kept == sorted([old, first])


def test_extend_adds_only_new_tags_and_keeps_a_backup(models, tmp_path):
    folder = dataset(tmp_path, colours=(RED,))
    (folder / "img0.txt").write_text("sks, 1girl, smiling", encoding="utf-8")
    caption_folder(folder, settings(models, "wd-tagger", existing="extend", prefix="sks"))
    assert read_caption(folder / "img0.txt") == ("sks, 1girl, smiling, hakurei reimu, red theme, "
                                                 "^_^, simple background")
    [backup] = (folder / BACKUP_FOLDER).rglob("img0.txt")
    assert backup.read_text(encoding="utf-8") == "sks, 1girl, smiling"


def test_extend_reads_a_utf16_caption_and_leaves_one_it_cannot_read(models, tmp_path):
    folder = dataset(tmp_path, colours=(RED, GREEN))
    (folder / "img0.txt").write_bytes("a photo of Zoë".encode("utf-16"))  # Notepad's "Unicode"
    latin = "a photo of Zoë".encode("latin-1")
    (folder / "img1.txt").write_bytes(latin)
    report = caption_folder(folder, settings(models, "florence2", existing="extend",
                                             max_tokens=4))
    text = (folder / "img0.txt").read_text(encoding="utf-8")  # rewritten as UTF-8
    assert text.startswith("a photo of Zoë. ") and len(text.strip()) > len("a photo of Zoë.")
    assert (folder / "img1.txt").read_bytes() == latin  # never rewritten
    [(image, reason)] = report.left_alone
    assert image.name == "img1.png" and "neither UTF-8 nor UTF-16" in reason


def test_the_dataset_caption_extension_is_used(models, tmp_path):
    folder = dataset(tmp_path, colours=(RED,))
    (folder / "img0.txt").write_text("not a caption here")
    caption_folder(folder, settings(models, "wd-tagger", caption_extension="caption"))
    assert read_caption(folder / "img0.caption").startswith("hakurei reimu")
    assert (folder / "img0.txt").read_text() == "not a caption here"


def test_stop_mid_batch_then_the_rerun_continues(models, tmp_path, loaded_models):
    folder = dataset(tmp_path, colours=(RED, GREEN, GREY, RED, GREEN))
    stop = threading.Event()
    chosen = settings(models, "florence2", batch_size=2, max_tokens=4, existing="replace")
    for i in range(5):  # replace: only the journal says what the stopped job finished
        (folder / f"img{i}.txt").write_text(f"old {i}")

    def stop_after_one(progress):
        if progress.done == 1:
            stop.set()

    first = caption_folder(folder, chosen, JobHooks(progress=stop_after_one), stop)
    assert first.status == "stopped" and [p.name for p in first.processed] == ["img0.png",
                                                                                "img1.png"]
    assert [read_caption(folder / f"img{i}.txt") for i in (2, 3, 4)] == ["old 2", "old 3",
                                                                       "old 4"]
    assert (folder / journal_name("caption")).exists() and not list(folder.glob(".*.tmp"))
    assert released(loaded_models)  # a stopped job lets its model go too
    second = caption_folder(folder, dataclasses.replace(chosen, batch_size=3))
    assert second.status == "finished" and second.earlier == 2
    assert [p.name for p in second.processed] == ["img2.png", "img3.png", "img4.png"]
    backups = sorted(p.read_text() for p in (folder / BACKUP_FOLDER).rglob("*.txt"))
    assert backups == [f"old {i}" for i in range(5)]  # each replaced caption kept, once


def test_weights_come_from_the_hugging_face_cache(models, tmp_path):
    cache = tmp_path / "hub"
    snapshot = put_in_cache(cache, "someone/tiny-wd", {})
    for name in ("model.onnx", "selected_tags.csv"):
        (snapshot / name).write_bytes((models["wd-tagger"] / name).read_bytes())
    folder = dataset(tmp_path, colours=(GREEN,))
    chosen = settings(models, "wd-tagger", model="someone/tiny-wd")
    report = caption_folder(folder, chosen, cache_dir=cache)
    assert report.status == "finished" and read_caption(folder / "img0.txt")


def test_offline_and_not_cached_is_refused_before_anything_is_written(models, tmp_path):
    folder = dataset(tmp_path)
    with pytest.raises(JobRefused, match="someone/absent is not in the Hugging Face cache"):
        caption_folder(folder, settings(models, "wd-tagger", model="someone/absent"),
                       cache_dir=tmp_path / "empty-cache")
    assert sorted(p.name for p in folder.iterdir()) == ["img0.png", "img1.png", "img2.png"]


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_tagger_model_is_refused_naming_the_file(models, tmp_path, damage):
    model = tmp_path / "tagger"
    model.mkdir()
    (model / "selected_tags.csv").write_bytes((models["wd-tagger"] / "selected_tags.csv")
                                              .read_bytes())
    whole = (models["wd-tagger"] / "model.onnx").read_bytes()
    (model / "model.onnx").write_bytes(whole[:len(whole) // 2] if damage == "truncated"
                                       else b"<html>rate limited</html>")
    folder = dataset(tmp_path)
    with pytest.raises(JobRefused, match="model.onnx is damaged or not an ONNX model"):
        caption_folder(folder, settings(models, "wd-tagger", model=str(model)))
    assert not list(folder.glob("*.txt")) and not (folder / LOCK_NAME).exists()


def test_a_tag_list_of_another_tagger_is_refused(models, tmp_path):
    model = tmp_path / "tagger"
    model.mkdir()
    (model / "model.onnx").write_bytes((models["wd-tagger"] / "model.onnx").read_bytes())
    (model / "selected_tags.csv").write_text("tag_id,name,category,count\n0,a,0,1\n")
    with pytest.raises(JobRefused, match="lists 1 tags but .* scores 8"):
        caption_folder(dataset(tmp_path), settings(models, "wd-tagger", model=str(model)))


def test_settings_are_checked_before_the_folder(tmp_path):
    problems = validate(CaptionSettings(prompt="Describe it", existing="overwrite",
                                        general_threshold=2.0, caption_extension="."))
    text = "\n".join(problems)
    assert "existing: expected one of skip, extend, replace, got 'overwrite'" in text
    assert "prompt: Florence-2 captions with a task token" in text
    assert "general_threshold" in text and "caption_extension" in text
    with pytest.raises(JobRefused, match="existing: expected one of"):
        caption_folder(tmp_path / "nowhere", CaptionSettings(existing="overwrite"))


def test_each_preset_is_a_valid_row():
    from modules.data.prep.caption import CAPTIONERS, PRESETS
    assert {p.values["captioner"] for p in PRESETS.values()} == set(CAPTIONERS)
    for name in PRESETS:
        assert validate(preset_settings(name)) == [], name
    assert preset_settings(None, captioner="wd-tagger").model.startswith("SmilingWolf/wd-")


@pytest.mark.skipif(os.name != "posix", reason="lock holder liveness is POSIX's")
def test_two_caption_jobs_on_one_folder(models, tmp_path):
    folder = dataset(tmp_path, colours=(RED,))
    second: list[str] = []

    def try_again(_progress):
        with pytest.raises(JobRefused) as err:
            caption_folder(folder, settings(models, "wd-tagger"))
        second.append(str(err.value))

    caption_folder(folder, settings(models, "wd-tagger", existing="replace"),
                   JobHooks(progress=try_again))
    assert "is in use by a caption job" in second[0]
