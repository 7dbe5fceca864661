"""The latent cache: hits and misses, what changes the key, corruption, atomic writes, flips."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from modules.data import latent_cache as latent_cache_module
from modules.data.dataset import ImageCaptionDataset, collate_examples, expand_repeats
from modules.data.folders import DatasetSource, scan_datasets
from modules.data.latent_cache import (CachedLatentDataset, LatentCache, cache_latents,
                                       vae_fingerprint)

RES = 16


class PoolEncoder:
    """A stand-in VAE: 8x average pooling, counting how many images it encoded."""

    def __init__(self) -> None:
        self.encoded = 0

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        self.encoded += pixels.shape[0]
        return F.avg_pool2d(pixels, 8)


def make_items(folder: Path, count: int = 3, repeats: int = 1):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.effect_noise((24, 16), 50 + i).convert("RGB").save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"caption {i}", encoding="utf-8")
    scan = scan_datasets([DatasetSource(folder, repeats=repeats)])
    return expand_repeats(scan)


def cache_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.iterdir()) if cache_dir.exists() else []


def run_cache(items, cache: LatentCache, encoder: PoolEncoder, **kwargs):
    options = {"resolution": RES, "batch_size": 2} | kwargs
    return cache_latents(items, encoder, cache, **options)


def test_second_run_hits_without_encoding(tmp_path: Path) -> None:
    items = make_items(tmp_path / "data", count=3, repeats=2)
    encoder, progress = PoolEncoder(), []

    first = run_cache(items, LatentCache(tmp_path / "cache", "vae-a"), encoder,
                      progress_callback=lambda done, total: progress.append((done, total)))
    second = run_cache(items, LatentCache(tmp_path / "cache", "vae-a"), encoder)

    assert (first.hits, first.misses) == (0, 3)  # repeats are encoded once
    assert (second.hits, second.misses) == (3, 0)
    assert encoder.encoded == 3
    assert len(cache_files(tmp_path / "cache")) == 3
    assert progress[-1] == (3, 3)


def test_cached_latent_is_what_encode_fn_returned(tmp_path: Path) -> None:
    items = make_items(tmp_path / "data", count=1)
    cache = LatentCache(tmp_path / "cache", "vae-a")
    stats = run_cache(items, cache, PoolEncoder())

    latent = cache.get(stats.entries[(items[0].path, (RES, RES))].keys[False])
    pixels = ImageCaptionDataset(items, RES)[0]["pixel_values"]

    assert latent is not None and latent.shape == (3, 2, 2)
    assert torch.allclose(latent, F.avg_pool2d(pixels[None], 8)[0])
    assert cache.get("0" * 64) is None


def test_image_content_change_is_a_miss(tmp_path: Path) -> None:
    items = make_items(tmp_path / "data", count=2)
    encoder = PoolEncoder()
    run_cache(items, LatentCache(tmp_path / "cache", "vae-a"), encoder)

    Image.new("RGB", (24, 16), (1, 2, 3)).save(items[0].path)  # same name, new content
    stats = run_cache(items, LatentCache(tmp_path / "cache", "vae-a"), encoder)

    assert (stats.hits, stats.misses) == (1, 1)


def test_resolution_crop_mode_and_vae_change_the_key(tmp_path: Path) -> None:
    items = make_items(tmp_path / "data", count=2)
    encoder = PoolEncoder()
    run_cache(items, LatentCache(tmp_path / "cache", "vae-a"), encoder)

    new_resolution = run_cache(items, LatentCache(tmp_path / "cache", "vae-a"), encoder,
                               resolution=8)
    new_vae = run_cache(items, LatentCache(tmp_path / "cache", "vae-b"), encoder)
    new_crop = run_cache(items, LatentCache(tmp_path / "cache", "vae-a"), encoder,
                         center_crop=False)

    assert new_resolution.misses == new_vae.misses == new_crop.misses == 2
    assert len(cache_files(tmp_path / "cache")) == 8


def test_corrupt_cache_file_is_reencoded_with_a_warning(tmp_path: Path, caplog) -> None:
    items = make_items(tmp_path / "data", count=2)
    encoder = PoolEncoder()
    stats = run_cache(items, LatentCache(tmp_path / "cache", "vae-a"), encoder)
    broken = LatentCache(tmp_path / "cache", "vae-a").path_for(
        stats.entries[(items[0].path, (RES, RES))].keys[False])
    broken.write_bytes(b"\x00\x01 not a safetensors file")

    with caplog.at_level(logging.WARNING, logger="tempera.data"):
        again = run_cache(items, LatentCache(tmp_path / "cache", "vae-a"), encoder)

    assert (again.hits, again.misses, again.corrupt) == (1, 1, 1)
    assert broken.name in caplog.text and "re-encoded" in caplog.text
    assert LatentCache(tmp_path / "cache", "vae-a").get(broken.stem) is not None


def test_failed_write_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    cache = LatentCache(tmp_path / "cache", "vae-a")
    cache.put("a" * 64, torch.ones(4, 2, 2))

    def write_half_then_fail(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(latent_cache_module, "save_file", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        cache.put("b" * 64, torch.zeros(4, 2, 2))
    with pytest.raises(OSError, match="disk full"):
        cache.put("a" * 64, torch.zeros(4, 2, 2))  # overwriting keeps the old entry

    assert [p.name for p in cache_files(tmp_path / "cache")] == [f"{'a' * 64}.safetensors"]
    assert torch.equal(cache.get("a" * 64), torch.ones(4, 2, 2))


def test_both_flips_are_cached_and_the_dataset_serves_them(tmp_path: Path) -> None:
    items = make_items(tmp_path / "data", count=2)
    cache = LatentCache(tmp_path / "cache", "vae-a")

    stats = run_cache(items, cache, PoolEncoder(), random_flip=True, seed=1)
    entry = stats.entries[(items[0].path, (RES, RES))]
    plain, mirrored = cache.get_entry(entry.keys[False]), cache.get_entry(entry.keys[True])

    assert stats.misses == 4 and len(cache_files(tmp_path / "cache")) == 4
    assert torch.allclose(mirrored.latent, plain.latent.flip(-1))
    assert plain.original_size == (16, 24) and plain.crop_top_left == (0, 4)
    assert mirrored.crop_top_left == (0, 24 - RES - 4)

    dataset = CachedLatentDataset(items, stats.entries, cache, random_flip=True, seed=1)
    pixels = ImageCaptionDataset(items, RES, random_flip=True, seed=1)
    served = [dataset[(epoch, 0)] for epoch in range(8)]
    assert {s["crop_top_left"] for s in served} == {(0, 4), (0, 24 - RES - 4)}
    for epoch, sample in enumerate(served):  # same flip as the pixel dataset would pick
        expected = F.avg_pool2d(pixels[(epoch, 0)]["pixel_values"][None], 8)[0]
        assert torch.allclose(sample["latents"], expected, atol=1e-6)
    batch = collate_examples([dataset[0], dataset[1]])
    assert batch["latents"].shape == (2, 3, 2, 2) and batch["caption"] == ["caption 0",
                                                                           "caption 1"]


class SizeCheckingEncoder(PoolEncoder):
    """A PoolEncoder that records the (height, width) of every batch it gets."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_sizes: list[tuple[int, int]] = []

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(tuple(pixels.shape[2:]))
        return super().__call__(pixels)


def test_bucketed_latents_have_their_bucket_size_and_encode_one_size_per_batch(
        tmp_path: Path) -> None:
    items = make_items(tmp_path / "data", count=3, repeats=2)  # 24 wide x 16 high, repeated
    buckets = [(16, 24), (16, 24), (16, 16), (16, 16), (16, 24), (16, 24)]
    cache, encoder = LatentCache(tmp_path / "cache", "vae-a"), SizeCheckingEncoder()

    stats = run_cache(items, cache, encoder, target_sizes=buckets, batch_size=4)
    dataset = CachedLatentDataset(items, stats.entries, cache, target_sizes=buckets)
    square = run_cache(items, LatentCache(tmp_path / "cache", "vae-a"), encoder)

    assert (stats.hits, stats.misses) == (0, 3)
    assert sorted(encoder.batch_sizes[:2]) == [(16, 16), (16, 24)]  # never a mixed batch
    shapes = [tuple(dataset[i]["latents"].shape) for i in (0, 2, 4)]
    assert shapes == [(3, 2, 3), (3, 2, 2), (3, 2, 3)]
    assert dataset[0]["original_size"] == (16, 24) and dataset[0]["crop_top_left"] == (0, 0)
    assert dataset.target_sizes == buckets
    # img1 was cached as a 16x16 square both times: the same key, a hit; the others differ.
    assert (square.hits, square.misses) == (1, 2)
    again = run_cache(items, LatentCache(tmp_path / "cache", "vae-a"), encoder,
                      target_sizes=buckets)
    assert (again.hits, again.misses) == (3, 0)


def tiny_vae(seed: int = 0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                         down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                         up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
                         block_out_channels=(8, 8), layers_per_block=1, norm_num_groups=4,
                         sample_size=RES).eval()


def test_vae_fingerprint_follows_config_and_weights() -> None:
    vae, twin = tiny_vae(0), tiny_vae(0)
    base = vae_fingerprint(vae)

    assert vae_fingerprint(twin) == base
    assert vae_fingerprint(tiny_vae(1)) != base
    with torch.no_grad():
        twin.encoder.conv_in.weight[0, 0, 0, 0] += 1e-3
    assert vae_fingerprint(twin) != base
    assert vae_fingerprint(twin, full_hash_limit_bytes=0) != vae_fingerprint(
        vae, full_hash_limit_bytes=0)  # sampled mode still sees a change at a tensor's start
    assert vae_fingerprint(vae.to(torch.float16)) != base


def test_real_tiny_vae_encodes_into_the_cache(tmp_path: Path) -> None:
    items = make_items(tmp_path / "data", count=3)
    vae = tiny_vae()

    def encode(pixels: torch.Tensor) -> torch.Tensor:
        return vae.encode(pixels).latent_dist.mode() * vae.config.scaling_factor

    cache = LatentCache(tmp_path / "cache", vae_fingerprint(vae))
    stats = cache_latents(items, encode, cache, resolution=RES, batch_size=2)
    dataset = CachedLatentDataset(items, stats.entries, cache)

    assert stats.misses == 3
    sample = dataset[2]
    with torch.no_grad():
        direct = encode(ImageCaptionDataset(items, RES)[2]["pixel_values"][None])[0]
    assert sample["latents"].shape == (4, RES // 2, RES // 2)
    assert torch.allclose(sample["latents"], direct, atol=1e-5)
    assert cache_latents(items, encode, LatentCache(tmp_path / "cache", vae_fingerprint(vae)),
                         resolution=RES).hits == 3
