"""Several resolutions in one run: every image a sample at each resolution, batches of one
shape over shuffled and resumed epochs, and latents cached per (image, resolution) beside a
single-resolution cache that stays valid."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from modules.data.buckets import assign_buckets, batch_shapes, plan_resolutions
from modules.data.dataset import (ImageCaptionDataset, SkipFirstBatches, collate_examples,
                                  epoch_batch_sampler, expand_repeats, set_sampler_epoch)
from modules.data.folders import DatasetSource, ScanItem, scan_datasets
from modules.data.latent_cache import CachedLatentDataset, LatentCache, cache_latents


def _folder(folder: Path, sizes: list[tuple[int, int]], seed: int = 70) -> Path:
    """Noise images of these (width, height) with captions."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (width, height) in enumerate(sizes):
        Image.effect_noise((width, height), seed + i).convert("RGB").save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"caption {i}", encoding="utf-8")
    return folder


def _items(tmp_path: Path) -> list[ScanItem]:
    first = _folder(tmp_path / "a", [(300, 180), (200, 200), (180, 300), (320, 190), (210, 200)])
    second = _folder(tmp_path / "b", [(400, 400), (390, 240)], seed=90)
    return expand_repeats(scan_datasets([DatasetSource(first), DatasetSource(second)]))


def test_each_image_is_bucketed_within_each_resolutions_pixel_budget(tmp_path: Path):
    items = _items(tmp_path)
    plan = plan_resolutions(items, [[256, 512], [256, 512]], aspect_buckets=True, max_aspect=2.0)

    assert plan.distinct == [256, 512] and len(plan.items) == 2 * len(items)
    for resolution in (256, 512):
        chosen = [i for i, r in enumerate(plan.resolutions) if r == resolution]
        assert [plan.items[i] for i in chosen] == items  # every image once per resolution
        assert [plan.target_sizes[i] for i in chosen] == assign_buckets(items, resolution, 2.0)
        assert all(h * w <= resolution ** 2 and h % 64 == 0 == w % 64
                   for h, w in (plan.target_sizes[i] for i in chosen))
    table = plan.table()
    assert [row["resolution"] for row in table] == [256, 512]
    assert [row["items"] for row in table] == [7, 7]
    assert table[0]["sizes"] == [{"height": 192, "width": 320, "items": 3},
                                 {"height": 256, "width": 256, "items": 3},
                                 {"height": 320, "width": 192, "items": 1}]
    assert "256 px: " in plan.describe() and "512 px: " in plan.describe()


def test_one_resolution_keeps_the_items_and_sizes_it_had_before(tmp_path: Path):
    items = _items(tmp_path)
    plan = plan_resolutions(items, [[256], [256]], aspect_buckets=True, max_aspect=2.0)
    assert plan.items == items and plan.target_sizes == assign_buckets(items, 256, 2.0)
    square = plan_resolutions(items, [[256], [256]], aspect_buckets=False, max_aspect=2.0)
    assert square.target_sizes == [(256, 256)] * len(items)


def test_a_datasets_own_resolutions(tmp_path: Path):
    items = _items(tmp_path)
    plan = plan_resolutions(items, [[64], [64, 128]], aspect_buckets=False, max_aspect=2.0)
    sources = [(item.source_index, r) for item, r in zip(plan.items, plan.resolutions)]
    assert sources.count((0, 64)) == 5 and sources.count((1, 64)) == 2
    assert sources.count((1, 128)) == 2 and (0, 128) not in sources
    assert [row["items"] for row in plan.table()] == [7, 2]


def _epochs(batches, epochs: int) -> list[list[tuple[int, int]]]:
    out = []
    for epoch in range(epochs):
        set_sampler_epoch(batches, epoch)
        out += list(batches)
    return out


def test_batches_never_mix_shapes_over_shuffled_and_resumed_epochs(tmp_path: Path):
    items = _items(tmp_path)
    plan = plan_resolutions(items, [[64, 128, 192]] * 2, aspect_buckets=True, max_aspect=2.0)
    sizes = plan.target_sizes

    def sampler(start_epoch: int = 0):
        return epoch_batch_sampler(len(sizes), 2, seed=5, start_epoch=start_epoch,
                                   buckets=sizes)

    full = _epochs(sampler(), 3)
    per_epoch = len(sampler())
    assert per_epoch * 3 == len(full)
    for batch in full:
        assert len({sizes[index] for _, index in batch}) == 1  # one shape per batch
    for epoch in range(3):  # every (image, resolution) sample once per epoch
        seen = sorted(i for b in full if b[0][0] == epoch for _, i in b)
        assert seen == list(range(len(sizes)))
    assert full[:per_epoch] != full[per_epoch:2 * per_epoch]  # shuffled anew each epoch
    # every resolution is mixed through the epoch, not trained one after another
    first_epoch_res = [plan.resolutions[b[0][1]] for b in full[:per_epoch]]
    assert first_epoch_res != sorted(first_epoch_res)
    # a run resumed after 3 batches of epoch 1 trains exactly the batches left
    resumed = sampler(start_epoch=1)
    rest = list(SkipFirstBatches(resumed, 3)) + _epochs_from(resumed, 2)
    assert rest == full[per_epoch + 3:]
    shapes = {(len(b), *sizes[b[0][1]]) for b in full}
    assert shapes == set(batch_shapes(sizes, 2))


def _epochs_from(batches, epoch: int) -> list:
    set_sampler_epoch(batches, epoch)
    return list(batches)


def test_the_unshuffled_sampler_also_keeps_one_shape(tmp_path: Path):
    items = _items(tmp_path)
    plan = plan_resolutions(items, [[64, 128]] * 2, aspect_buckets=False, max_aspect=2.0)
    batches = epoch_batch_sampler(len(plan.items), 3, seed=5, shuffle=False,
                                  buckets=plan.target_sizes)
    dataset = ImageCaptionDataset(plan.items, 64, target_sizes=plan.target_sizes)
    for batch in batches:
        pixels = collate_examples([dataset[key] for key in batch])["pixel_values"]
        assert pixels.shape[2] == pixels.shape[3] in (64, 128)


class PoolEncoder:
    """A stand-in VAE: 8x average pooling, counting the (height, width) of what it encoded."""

    def __init__(self) -> None:
        self.sizes: list[tuple[int, int]] = []

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        self.sizes += [tuple(pixels.shape[2:])] * pixels.shape[0]
        return F.avg_pool2d(pixels, 8)


def test_latents_cached_per_resolution_leave_a_single_resolution_cache_valid(tmp_path: Path):
    items = _items(tmp_path)
    cache_dir = tmp_path / "cache"
    old = cache_latents(items, PoolEncoder(), LatentCache(cache_dir, "vae"), resolution=64)
    before = {p.name: p.read_bytes() for p in cache_dir.iterdir()}

    plan = plan_resolutions(items, [[64, 128]] * 2, aspect_buckets=False, max_aspect=2.0)
    encoder, cache = PoolEncoder(), LatentCache(cache_dir, "vae")
    stats = cache_latents(plan.items, encoder, cache, resolution=64,
                          target_sizes=plan.target_sizes)

    # the 64 px entries were reused as they were; only the 128 px ones were encoded
    assert (stats.hits, stats.misses) == (7, 7) and set(encoder.sizes) == {(128, 128)}
    assert {p.name: p.read_bytes() for p in cache_dir.iterdir() if p.name in before} == before
    assert len(list(cache_dir.iterdir())) == 14  # keys of the two sizes never collide
    for path in {item.path for item in items}:
        assert stats.entries[(path, (64, 64))] == old.entries[(path, (64, 64))]
    dataset = CachedLatentDataset(plan.items, stats.entries, cache,
                                  target_sizes=plan.target_sizes)
    pixels = ImageCaptionDataset(plan.items, 64, target_sizes=plan.target_sizes)
    for index, resolution in enumerate(plan.resolutions):  # each sample at its own size
        latent = dataset[index]["latents"]
        assert latent.shape[-1] == resolution // 8
        expected = F.avg_pool2d(pixels[index]["pixel_values"][None], 8)[0]
        assert torch.allclose(latent, expected, atol=1e-6)
    try:  # without each item's size the dataset cannot tell which entry it means
        CachedLatentDataset(plan.items, stats.entries, cache)
    except ValueError as exc:
        assert "cached at 2 sizes" in str(exc)
    else:
        raise AssertionError("an ambiguous entry was served")

