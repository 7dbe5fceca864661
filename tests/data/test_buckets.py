"""Aspect-ratio buckets: which sizes exist, which one an image gets, and how it is cropped."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from modules.data.buckets import assign_buckets, bucket_counts, describe_buckets, nearest_bucket
from modules.geometry import BUCKET_STEP, aspect_of, bucket_sizes, narrowest_non_square
from modules.data.dataset import ImageCaptionDataset, collate_examples, expand_repeats
from modules.data.folders import DatasetSource, ScanItem, scan_datasets
from modules.data.images import load_training_image, plan_crop, resized_size


@pytest.mark.parametrize("resolution", [256, 384, 512, 768, 1024, 2048])
@pytest.mark.parametrize("max_aspect", [1.7, 2.0, 4.0])
def test_buckets_are_multiples_of_64_near_the_square_area_within_the_aspect_limit(
        resolution, max_aspect):
    buckets = bucket_sizes(resolution, max_aspect)

    area = resolution * resolution
    assert (resolution, resolution) in buckets
    assert len(set(buckets)) == len(buckets) > 1
    for height, width in buckets:
        assert height % BUCKET_STEP == 0 and width % BUCKET_STEP == 0
        assert 0.85 * area <= height * width <= area, (height, width)
        assert max(height, width) / min(height, width) <= max_aspect
        assert (width, height) in buckets  # every portrait has its landscape twin
    assert [aspect_of(b) for b in buckets] == sorted(aspect_of(b) for b in buckets)


def test_sdxl_resolution_gives_the_usual_buckets():
    assert bucket_sizes(1024, 2.0) == [(768, 1344), (832, 1216), (896, 1152), (960, 1088),
                                       (1024, 1024), (1088, 960), (1152, 896), (1216, 832),
                                       (1344, 768)]


def test_a_larger_max_aspect_only_adds_more_elongated_buckets():
    narrow, wide = bucket_sizes(512, 2.0), bucket_sizes(512, 4.0)
    assert set(narrow) < set(wide)
    assert all(max(aspect_of(b), 1 / aspect_of(b)) > 2.0 for b in set(wide) - set(narrow))


def test_small_resolutions_and_bad_arguments():
    assert bucket_sizes(64, 4.0) == [(64, 64)]
    assert bucket_sizes(128, 2.0) == [(128, 128)]  # 64x256 would be 4:1
    assert bucket_sizes(128, 4.0) == [(64, 256), (128, 128), (256, 64)]
    assert narrowest_non_square(64) is None
    assert narrowest_non_square(256) == pytest.approx(320 / 192)
    with pytest.raises(ValueError, match="multiple of 64"):
        bucket_sizes(100, 2.0)
    with pytest.raises(ValueError, match="max_aspect"):
        bucket_sizes(512, 0.5)


@pytest.mark.parametrize("size, expected", [
    ((1080, 1920), (384, 640)),   # 16:9 landscape -> the widest bucket
    ((1920, 1080), (640, 384)),   # 9:16 portrait -> the tallest
    ((700, 700), (512, 512)),     # square
    ((600, 800), (448, 576)),     # 3:4 landscape (0.75) -> 0.78, not 0.6
    ((800, 600), (576, 448)),
    ((100, 5000), (384, 640)),    # beyond the limit: the most elongated bucket
])
def test_each_image_gets_the_bucket_nearest_its_aspect_ratio(size, expected):
    buckets = bucket_sizes(512, 2.0)

    assert nearest_bucket(size, buckets) == expected
    height, width = size
    distance = [abs(math.log(aspect_of(b)) - math.log(height / width)) for b in buckets]
    assert distance[buckets.index(expected)] == min(distance)


def test_nearest_is_symmetric_between_portrait_and_landscape():
    buckets = bucket_sizes(768, 3.0)
    for height in range(200, 1400, 37):
        width = 1000
        tall, wide = nearest_bucket((height, width), buckets), nearest_bucket((width, height),
                                                                              buckets)
        assert tall == (wide[1], wide[0])


def test_assignment_uses_the_size_after_exif_rotation(tmp_path: Path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: stored landscape, shown portrait
    Image.new("RGB", (640, 384), "red").save(tmp_path / "rotated.jpg", exif=exif)
    Image.new("RGB", (640, 384), "red").save(tmp_path / "wide.jpg")

    scan = scan_datasets([DatasetSource(tmp_path)])

    # The scan read the header's size, not the reduced size of its quick check decode.
    assert [item.size for item in scan.items] == [(640, 384), (384, 640)]
    assert assign_buckets(scan.items, 512, 2.0) == [(640, 384), (384, 640)]
    by_hand = [ScanItem(item.path, "", 0) for item in scan.items]  # no size: header read
    assert assign_buckets(by_hand, 512, 2.0) == [(640, 384), (384, 640)]


def test_a_landscape_image_is_resized_to_cover_its_bucket_and_center_cropped(tmp_path: Path):
    path = tmp_path / "wide.png"
    Image.effect_noise((200, 100), 50).convert("RGB").save(path)  # width 200, height 100
    bucket = nearest_bucket((100, 200), bucket_sizes(256, 2.0))

    image = load_training_image(path, bucket, center_crop=True, random_flip=False)

    assert bucket == (192, 320)
    assert resized_size(100, 200, bucket) == (192, 384)  # height fits, width overhangs
    assert image.pixels.shape == (3, 192, 320)
    assert image.original_size == (100, 200)
    assert image.crop_top_left == (0, 32)
    # the square path is unchanged: short side = resolution
    assert resized_size(100, 200, 256) == (256, 512)


def test_random_crop_and_flip_in_a_bucket_report_the_real_position(tmp_path: Path):
    import random
    path = tmp_path / "tall.png"
    Image.effect_noise((100, 300), 51).convert("RGB").save(path)
    bucket = (320, 192)  # resized to 192 x 576: 256 px of vertical play

    crops = [load_training_image(path, bucket, center_crop=False, random_flip=True,
                                 rng=random.Random(seed)) for seed in range(30)]

    assert {c.pixels.shape for c in crops} == {torch.Size([3, 320, 192])}
    assert all(c.original_size == (300, 100) for c in crops)
    assert all(0 <= c.crop_top_left[0] <= 576 - 320 and c.crop_top_left[1] == 0 for c in crops)
    assert len({c.crop_top_left[0] for c in crops}) > 5
    assert plan_crop((300, 100), bucket, True, None) == (128, 0)


def _mixed_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, (width, height) in enumerate([(100, 60), (64, 64), (60, 100), (120, 70)]):
        Image.effect_noise((width, height), 60 + i).convert("RGB").save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"caption {i}", encoding="utf-8")
    return folder


def test_dataset_items_take_their_bucket_and_collate_within_one(tmp_path: Path):
    items = expand_repeats(scan_datasets([DatasetSource(_mixed_folder(tmp_path / "d"))]))
    sizes = assign_buckets(items, 256, 2.0)
    dataset = ImageCaptionDataset(items, 256, target_sizes=sizes)

    assert sizes == [(192, 320), (256, 256), (320, 192), (192, 320)]
    assert [tuple(dataset[i]["pixel_values"].shape[1:]) for i in range(4)] == sizes
    batch = collate_examples([dataset[0], dataset[3]])
    assert batch["pixel_values"].shape == (2, 3, 192, 320)
    assert batch["original_size"].tolist() == [[60, 100], [70, 120]]
    with pytest.raises(ValueError, match="3 target sizes for 4 items"):
        ImageCaptionDataset(items, 256, target_sizes=sizes[:3])


def test_bucket_summary_lists_items_per_bucket_widest_first():
    sizes = [(320, 192), (192, 320), (192, 320), (256, 256)]

    assert bucket_counts(sizes) == [{"height": 192, "width": 320, "items": 2},
                                    {"height": 256, "width": 256, "items": 1},
                                    {"height": 320, "width": 192, "items": 1}]
    assert "192x320: 2, 256x256: 1, 320x192: 1" in describe_buckets(sizes)
