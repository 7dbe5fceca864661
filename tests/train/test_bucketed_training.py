"""Aspect-ratio buckets through the real trainer: compiled without recompiles after the first
pass over the buckets, the step budget counted from bucket batches, latent caching, SDXL's
size conditioning."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from modules.data.buckets import assign_buckets
from modules.data.dataset import ImageCaptionDataset, collate_examples, expand_repeats
from modules.data.folders import DatasetSource, scan_datasets
from modules.events import RecordingCallbacks
from modules.models.families.sdxl import sdxl_time_ids, size_conditioning
from modules.train.recipe.batch_shapes import BatchShapeLog
from modules.train.trainer import train

# At resolution 256 (max aspect 2) the buckets are 192x320, 256x256 and 320x192 (h x w).
RESOLUTION = 256
BUCKETS = [(192, 320), (256, 256), (320, 192)]
WIDE, SQUARE, TALL = (120, 60), (64, 64), (60, 120)  # PIL sizes: (width, height)


def make_images(folder: Path, sizes: list[tuple[int, int]]) -> Path:
    """Small noise PNGs with captions; the trainer scales them up to cover their bucket."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(sizes):
        Image.effect_noise(size, 30 + i).convert("RGB").save(folder / f"img{i:02d}.png")
        (folder / f"img{i:02d}.txt").write_text(f"a noisy picture number {i}", encoding="utf-8")
    return folder


def bucket_config(tiny_config, folder: Path, *overrides: str):
    return tiny_config(f"data.datasets[0].path={folder}", f"data.resolution={RESOLUTION}",
                       "data.aspect_buckets=true", "training.max_steps=0", *overrides)


def record_of(result) -> dict:
    return json.loads((result.output_dir / "run.json").read_text())


@pytest.fixture
def fresh_dynamo():
    """No compiled frames from earlier tests: this test counts recompiles."""
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("settings", [
    (),  # the defaults: REGIONAL scope, AUTO shapes
    ("compile.dynamic=DYNAMIC",),
    ("compile.scope=FULL", "compile.dynamic=AUTO"),  # latents marked dynamic up front
], ids=["regional-auto", "regional-dynamic", "full-auto"])
def test_compiled_buckets_do_not_recompile_after_the_first_pass(tiny_config, tmp_path,
                                                                fresh_dynamo, settings):
    folder = make_images(tmp_path / "data", [WIDE, WIDE, SQUARE, SQUARE, TALL, TALL])
    callbacks = RecordingCallbacks()

    result = train(bucket_config(tiny_config, folder, "training.epochs=3",
                                 "compile.backend=AOT_EAGER", *settings), callbacks)

    record = record_of(result)
    shapes = record["batch_shapes"]
    assert result.steps == 9  # 3 buckets of one full batch each, 3 epochs
    assert shapes["distinct"] == 3
    assert sorted((s["batch"], s["height"], s["width"]) for s in shapes["shapes"]) == \
        [(2, h, w) for h, w in BUCKETS]
    assert shapes["first_pass_micro_steps"] == 3 and shapes["micro_steps"] == 9
    assert shapes["recompiles_after_first_pass"] == 0
    assert shapes["recompiles"] == record["compile"]["unet"]["recompiles"]
    assert record["compile"]["unet"]["compiled_code_ran"]
    if "compile.scope=FULL" in settings:  # marked dynamic: one compile serves every bucket
        assert shapes["recompiles"] == 0
    assert [(b["height"], b["width"], b["items"]) for b in record["buckets"]["sizes"]] == \
        [(h, w, 2) for h, w in BUCKETS]
    assert not any(e.kind == "recompile" for e in callbacks.compile_events)
    assert all(torch.isfinite(torch.tensor(record["losses"])))


def test_uneven_buckets_with_cached_latents_count_every_batch(tiny_config, tmp_path):
    # 3 wide, 1 square, 2 tall at batch size 2: batches of 2+1, 1 and 2 = 4 per epoch, 2 short.
    folder = make_images(tmp_path / "data", [WIDE, WIDE, WIDE, SQUARE, TALL, TALL])
    callbacks = RecordingCallbacks()
    options = ("training.epochs=2", "training.gradient_accumulation=2",
               "data.cache_latents=true", "data.cache_text_encoder_outputs=true")

    result = train(bucket_config(tiny_config, folder, *options), callbacks)
    again = train(bucket_config(tiny_config, folder, *options,
                                f"output.dir={tmp_path / 'again'}"), RecordingCallbacks())

    record = record_of(result)
    assert record["buckets"]["batches_per_epoch"] == 4
    assert record["buckets"]["short_batches_per_epoch"] == 2
    assert result.steps == 4  # 2 optimizer steps (of 2 micro-batches) per epoch
    assert record["batch_shapes"]["micro_steps"] == 8
    assert sorted((s["batch"], s["height"], s["width"])
                  for s in record["batch_shapes"]["shapes"]) == \
        [(1, 192, 320), (1, 256, 256), (2, 192, 320), (2, 320, 192)]
    assert any("6 encoded" in s for s in callbacks.statuses)
    assert any("aspect buckets: 3 bucket(s)" in s and "2 short" in s for s in callbacks.statuses)
    assert record_of(again)["losses"] == record["losses"]  # from the cache, the same run

    latent_files = list((Path(record_dir(result)) / "latents").glob("*.safetensors"))
    shapes = set()
    for path in latent_files:
        with safe_open(str(path), framework="pt") as file:
            shapes.add(tuple(file.get_tensor("latent").shape[1:]))
    assert {(h // 8, w // 8) for h, w in BUCKETS} <= shapes


def record_dir(result) -> str:
    config = json.loads((result.output_dir / "config.json").read_text())
    return config["general"]["cache_dir"]


def test_size_conditioning_uses_the_real_crop_and_the_bucket_size(tmp_path):
    folder = make_images(tmp_path / "data", [WIDE, TALL])
    items = expand_repeats(scan_datasets([DatasetSource(folder)]))
    dataset = ImageCaptionDataset(items, RESOLUTION,
                                  target_sizes=assign_buckets(items, RESOLUTION, 2.0))

    wide = collate_examples([dataset[0]])
    tall = collate_examples([dataset[1]])
    time_ids = [sdxl_time_ids(size_conditioning(batch, *batch["pixel_values"].shape[2:]),
                              torch.device("cpu"), torch.float32)
                for batch in (wide, tall)]

    # 60x120 (h x w) covers 192x320 at 192x384: 32 px cut left and right; the tall one mirrors.
    assert time_ids[0].tolist() == [[60, 120, 0, 32, 192, 320]]
    assert time_ids[1].tolist() == [[120, 60, 32, 0, 320, 192]]


def test_sdxl_trains_with_buckets_and_conditions_on_the_bucket(tiny_config, tmp_path,
                                                               monkeypatch):
    import modules.models.families.sdxl as sdxl
    seen: list[list[list[int]]] = []

    def spy(sizes, device, dtype):
        seen.append([[*o, *c, *t] for o, c, t in zip(sizes["original_size"],
                                                      sizes["crop_top_left"],
                                                      sizes["target_size"])])
        return sdxl_time_ids(sizes, device, dtype)

    monkeypatch.setattr(sdxl, "sdxl_time_ids", spy)
    folder = make_images(tmp_path / "data", [WIDE, SQUARE, TALL])

    result = train(bucket_config(tiny_config, folder, "model.path=builtin:tiny-sdxl",
                                 "model.type=SDXL", "training.batch_size=1"))

    assert result.steps == 3
    assert sorted(row for rows in seen for row in rows) == [
        [60, 120, 0, 32, 192, 320], [64, 64, 0, 0, 256, 256], [120, 60, 32, 0, 320, 192]]


def test_shape_log_counts_recompiles_only_after_every_shape_was_seen():
    log, recompiles = BatchShapeLog(), iter([1, 3])

    for shape in [(2, 64, 64), (2, 64, 64), (2, 64, 128), (2, 64, 64), (2, 64, 128)]:
        log.add(shape, lambda: next(recompiles))

    report = log.report(recompiles=5)
    assert report["distinct"] == 2 and report["micro_steps"] == 5
    assert report["first_pass_micro_steps"] == 3
    assert (report["recompiles_in_first_pass"], report["recompiles_after_first_pass"]) == (3, 2)
