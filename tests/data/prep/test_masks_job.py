"""The mask job end to end (modules/data/prep/masks_job.py) with tiny models built here: a
random-weight CLIPSeg and a small ONNX background remover that keeps red pixels. Masks are
checked the way a training run reads them (modules/data/masks.py)."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modules.data.masks import check_mask, load_masked_sample
from modules.data.prep import masks_job
from modules.data.prep.job import LOCK_NAME, JobHooks, JobRefused, journal_name
from modules.data.prep.mask_ops import MaskShape
from modules.data.prep.masks_job import REPLACED_FOLDER, MaskSettings, make_masks, mask_path
from tests.data.prep.tiny_mask_models import build_tiny_background, build_tiny_clipseg

pytest.importorskip("rembg")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mask_models")
    return {"clipseg": build_tiny_clipseg(root / "clipseg"),
            "background": build_tiny_background(root / "background.onnx")}


def clipseg(models, **options) -> MaskSettings:
    return MaskSettings(segmenter="clipseg", prompts=("person", "the dog"),
                        model=str(models["clipseg"]), offline=True, device="cpu", **options)


def background(models, **options) -> MaskSettings:
    return MaskSettings(segmenter="background", model="u2net",
                        model_file=models["background"], offline=True, **options)


def red_square(width: int = 48, height: int = 32) -> Image.Image:
    """Blue, with a red square of a third of the height at the left (the subject)."""
    image = Image.new("RGB", (width, height), (0, 0, 255))
    image.paste((255, 0, 0), (4, 4, 4 + height // 3, 4 + height // 3))
    return image


def make_folder(root: Path, n: int = 3) -> Path:
    folder = root / "images"
    folder.mkdir(parents=True)
    for i in range(n):
        red_square(40 + 8 * i, 32).save(folder / f"img{i}.png")
    return folder


def test_clipseg_masks_are_written_where_training_reads_them(tiny_models, tmp_path):
    folder = make_folder(tmp_path)
    rotated = red_square(40, 24)  # stored landscape, shown portrait (EXIF orientation 6)
    exif = rotated.getexif()
    exif[0x0112] = 6
    rotated.save(folder / "phone.jpg", exif=exif)
    progress = []
    report = make_masks(folder, clipseg(tiny_models, batch_size=2),
                        JobHooks(progress=progress.append))
    assert report.status == "finished" and len(report.processed) == 4
    assert sorted(p.name for p in report.written) == [
        "img0_mask.png", "img1_mask.png", "img2_mask.png", "phone_mask.png"]
    assert [p.done for p in progress] == [1, 2, 3, 4] and progress[-1].eta_seconds == 0
    for image in [folder / "img0.png", folder / "img1.png", folder / "img2.png",
                  folder / "phone.jpg"]:
        with Image.open(image) as opened:
            size = opened.size
        with Image.open(mask_path(image)) as mask:
            assert mask.mode == "L"
            assert set(np.unique(np.asarray(mask))) <= {0, 255}  # threshold 0.5: hard
        # (height, width) as training sees it: the phone picture turned upright by its EXIF
        hw = (size[0], size[1]) if image.suffix == ".jpg" else (size[1], size[0])
        assert check_mask(mask_path(image), hw) is None, image
        _pixels, loaded = load_masked_sample(image, mask_path(image), False, 32, True, False,
                                             None)
        assert loaded.shape[-2:] == (32, 32)
    assert not (folder / LOCK_NAME).exists() and not (folder / journal_name("mask")).exists()


def test_several_prompts_keep_the_union(tiny_models, tmp_path):
    folders = {}
    for prompts in (("person",), ("the dog",), ("person", "the dog")):
        folders[prompts] = tmp_path / "_".join(p.replace(" ", "") for p in prompts)
        folders[prompts].mkdir()
        # The model's own size (32 px), so the masks are its probabilities, not resized ones.
        red_square(32, 32).save(folders[prompts] / "img0.png")
        settings = MaskSettings(prompts=prompts, model=str(tiny_models["clipseg"]),
                                shape=MaskShape(threshold=None), offline=True, device="cpu")
        make_masks(folders[prompts], settings)
    one, other, both = (np.asarray(Image.open(mask_path(f / "img0.png"))).astype(int)
                        for f in folders.values())
    assert np.abs(np.maximum(one, other) - both).max() <= 1
    assert (one != other).any()  # the prompts do matter


def test_background_remover_keeps_the_subject_and_the_options_apply(tiny_models, tmp_path):
    folder = make_folder(tmp_path, 1)
    make_masks(folder, background(tiny_models))
    mask = np.asarray(Image.open(mask_path(folder / "img0.png"))) > 127
    assert mask[6:12, 6:12].all() and not mask[:, 20:].any()  # the red square, nothing else
    plain = mask.sum()

    grown = make_folder(tmp_path / "grown", 1)
    make_masks(grown, background(tiny_models, shape=MaskShape(dilate=3, blur=1.0,
                                                              invert=True)))
    inverted = np.asarray(Image.open(mask_path(grown / "img0.png")))
    assert inverted[8, 8] == 0 and inverted[20, 35] == 255  # the subject is left out
    assert (inverted < 128).sum() > plain  # grown before inverting
    assert ((inverted > 0) & (inverted < 255)).any()  # blurred edge

    shrunk = make_folder(tmp_path / "shrunk", 1)
    statuses: list[str] = []
    make_masks(shrunk, background(tiny_models, shape=MaskShape(dilate=-20)),
               JobHooks(status=statuses.append))  # shrunk to nothing: a mask that keeps none
    assert not np.asarray(Image.open(mask_path(shrunk / "img0.png"))).any()
    assert [s for s in statuses if s.startswith("img0_mask.png: the mask keeps no pixel")]


def test_existing_masks_are_kept_unless_replaced_and_a_replaced_one_is_never_lost(
        tiny_models, tmp_path):
    folder = make_folder(tmp_path, 2)
    mine = folder / "img0_mask.png"
    Image.new("L", (40, 32), 77).save(mine)
    mine_bytes = mine.read_bytes()
    report = make_masks(folder, background(tiny_models))
    assert mine.read_bytes() == mine_bytes
    assert [p.name for p, _ in report.left_alone] == ["img0.png"]
    assert [p.name for p in report.written] == ["img1_mask.png"]

    report = make_masks(folder, background(tiny_models, existing="replace"))
    assert sorted(p.name for p in report.written) == ["img0_mask.png", "img1_mask.png"]
    assert mine.read_bytes() != mine_bytes
    kept = list((folder / REPLACED_FOLDER).rglob("*.png"))
    assert sorted(p.name for p in kept) == ["img0_mask.png", "img1_mask.png"]
    assert [p for p in kept if p.read_bytes() == mine_bytes]
    # The kept masks are hidden from the dataset scan: not images, not masks.
    from modules.data.prep.job import list_images
    assert sorted(p.name for p in list_images(folder, recursive=True)) == ["img0.png",
                                                                           "img1.png"]


def test_stop_mid_job_and_a_rerun_continues(tiny_models, tmp_path):
    folder = make_folder(tmp_path, 5)
    stop = threading.Event()

    def progress(p):
        if p.done == 1:
            stop.set()  # pressed while the first batch runs: that batch finishes

    report = make_masks(folder, background(tiny_models, batch_size=2),
                        JobHooks(progress=progress), stop)
    assert report.status == "stopped" and len(report.written) == 2
    assert sorted(p.name for p in folder.glob("*_mask.png")) == ["img0_mask.png",
                                                                 "img1_mask.png"]
    first = {p: p.stat().st_mtime_ns for p in folder.glob("*_mask.png")}
    assert (folder / journal_name("mask")).exists() and not (folder / LOCK_NAME).exists()

    report = make_masks(folder, background(tiny_models, batch_size=2))
    assert report.status == "finished" and report.earlier == 2
    assert sorted(p.name for p in report.written) == ["img2_mask.png", "img3_mask.png",
                                                      "img4_mask.png"]
    assert all(p.stat().st_mtime_ns == t for p, t in first.items())
    assert not (folder / journal_name("mask")).exists()


def test_a_rerun_with_the_same_settings_does_only_what_is_left(tiny_models, tmp_path):
    folder = make_folder(tmp_path, 4)
    stop = threading.Event()
    settings = background(tiny_models, batch_size=1, existing="replace")
    make_masks(folder, settings, JobHooks(progress=lambda p: stop.set()), stop)
    done = {p: p.stat().st_mtime_ns for p in folder.glob("*_mask.png")}
    assert len(done) == 1
    report = make_masks(folder, settings)
    assert report.status == "finished" and report.earlier == 1 and len(report.written) == 3
    assert all(p.stat().st_mtime_ns == t for p, t in done.items())  # not made again
    assert not (folder / REPLACED_FOLDER).exists()  # nothing was replaced twice


def test_the_model_is_released_after_the_job(tiny_models, tmp_path, monkeypatch):
    folder = make_folder(tmp_path, 2)
    loaded = []
    real = masks_job.load_clipseg

    def spy(*args, **kwargs):
        masker = real(*args, **kwargs)
        loaded.append(weakref.ref(masker.model))
        return masker

    monkeypatch.setattr(masks_job, "load_clipseg", spy)
    assert make_masks(folder, clipseg(tiny_models)).status == "finished"
    assert len(loaded) == 1 and loaded[0]() is None


def test_bad_images_are_skipped_and_named(tiny_models, tmp_path):
    folder = make_folder(tmp_path, 2)
    (folder / "empty.png").write_bytes(b"")
    (folder / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    report = make_masks(folder, background(tiny_models))
    assert report.status == "finished"
    assert sorted(p.name for p in report.written) == ["img0_mask.png", "img1_mask.png"]
    reasons = {p.name: why for p, why in report.skipped}
    assert set(reasons) == {"empty.png", "broken.jpg"} and "0 bytes" in reasons["empty.png"]
    assert any("broken.jpg" in line for line in report.lines())
    assert not (folder / "empty_mask.png").exists()


def test_a_damaged_model_is_refused_before_anything_is_written(tiny_models, tmp_path):
    folder = make_folder(tmp_path, 2)
    damaged = tmp_path / "damaged.onnx"
    damaged.write_bytes(tiny_models["background"].read_bytes()[:300])
    settings = MaskSettings(segmenter="background", model="u2net", model_file=damaged,
                            offline=True)
    with pytest.raises(JobRefused, match="cannot load the background model .*damaged.onnx"):
        make_masks(folder, settings)
    clip = tmp_path / "clipseg"
    shutil.copytree(tiny_models["clipseg"], clip)
    weights = clip / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(JobRefused, match="cannot load CLIPSeg"):
        make_masks(folder, MaskSettings(prompts=("person",), model=str(clip), offline=True))
    assert not list(folder.glob("*_mask.png")) and not (folder / LOCK_NAME).exists()
    assert not (folder / journal_name("mask")).exists()


def test_a_background_model_not_downloaded_is_refused_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("REMBG_HOME", str(tmp_path / "rembg-home"))  # rembg's folder: empty
    monkeypatch.delenv("U2NET_HOME", raising=False)
    folder = make_folder(tmp_path, 1)
    with pytest.raises(JobRefused, match="u2netp is not downloaded .*--model-file"):
        make_masks(folder, MaskSettings(segmenter="background", model="u2netp", offline=True))


def test_a_background_model_in_rembgs_folder_is_used_without_a_download(tiny_models, tmp_path,
                                                                       monkeypatch):
    home = tmp_path / "rembg-home"
    monkeypatch.setenv("REMBG_HOME", str(home))
    monkeypatch.delenv("U2NET_HOME", raising=False)
    (home / "models" / "u2net").mkdir(parents=True)
    shutil.copy(tiny_models["background"], home / "models" / "u2net" / "u2net.onnx")
    folder = make_folder(tmp_path, 1)
    statuses: list[str] = []
    report = make_masks(folder, MaskSettings(segmenter="background", model="u2net",
                                             offline=True), JobHooks(status=statuses.append))
    assert [p.name for p in report.written] == ["img0_mask.png"]
    assert any(str(home / "models" / "u2net" / "u2net.onnx") in s for s in statuses)
    assert any("runs on the CPU" in s for s in statuses)


@pytest.mark.parametrize("settings, problem", [
    (MaskSettings(segmenter="clipseg"), "needs at least one prompt"),
    (MaskSettings(segmenter="background", prompts=("dog",)), "takes no prompt"),
    (MaskSettings(segmenter="background", model="u3net"), "got 'u3net'"),
    (MaskSettings(prompts=("dog",), existing="overwrite"), "existing"),
    (MaskSettings(prompts=("dog",), shape=MaskShape(threshold=2.0)), "threshold"),
])
def test_bad_settings_are_refused_with_the_reason(tmp_path, settings, problem):
    folder = make_folder(tmp_path, 1)
    with pytest.raises(JobRefused, match=problem):
        make_masks(folder, settings)
    assert sorted(p.name for p in folder.iterdir()) == ["img0.png"]


def test_a_second_job_on_the_folder_is_refused(tiny_models, tmp_path):
    folder = make_folder(tmp_path, 1)
    sleeper = subprocess.Popen(["sleep", "30"])  # a live process holds the folder's lock
    try:
        (folder / LOCK_NAME).write_text(json.dumps(
            {"kind": "caption", "pid": sleeper.pid, "host": socket.gethostname(),
             "started": "2026-01-01 10:00:00"}))
        with pytest.raises(JobRefused, match=f"in use by a caption job \\(process "
                                             f"{sleeper.pid}"):
            make_masks(folder, background(tiny_models))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not (folder / "img0_mask.png").exists()


def test_a_folder_that_is_not_writable_is_refused(tiny_models, read_only_folder):
    with pytest.raises(JobRefused, match="is not writable"):
        make_masks(read_only_folder, background(tiny_models))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_clipseg_on_the_gpu_makes_the_masks_the_cpu_makes(tiny_models, tmp_path):
    """float16 on the GPU: the same thresholded masks as float32 on the CPU, but for a few
    pixels at the threshold."""
    masks = {}
    for device in ("cpu", "cuda"):
        folder = make_folder(tmp_path / device, 2)
        settings = MaskSettings(prompts=("person",), model=str(tiny_models["clipseg"]),
                                offline=True, device=device)
        assert make_masks(folder, settings).status == "finished"
        masks[device] = np.asarray(Image.open(mask_path(folder / "img1.png")))
    assert (masks["cpu"] != masks["cuda"]).mean() < 0.02
