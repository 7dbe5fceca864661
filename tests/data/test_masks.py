"""Masked loss: the loss on fixed tensors, zero gradient where masked, the mask following the
image's crop and flip, mask files and alpha channels, bad masks, and masks in the latent cache."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from modules.data.dataset import ImageCaptionDataset, collate_examples, expand_repeats
from modules.data.errors import DatasetError
from modules.data.folders import DatasetSource, scan_datasets
from modules.data.latent_cache import (CachedLatentDataset, LatentCache, cache_latents,
                                       latent_key)
from modules.data.masks import latent_mask, load_masked_sample
from modules.config.loss import LossType
from modules.train.recipe.objectives import diffusion_loss, elementwise_loss, masked_sample_mean


def diffusion_mse(prediction, target, weights, mask=None):
    """The training step's MSE loss: per element, then reduced with weights and mask."""
    return diffusion_loss(elementwise_loss(prediction, target, LossType.MSE), weights, mask)


def test_the_masked_loss_is_the_mask_weighted_mean_per_sample():
    torch.manual_seed(0)
    prediction, target = torch.randn(2, 4, 2, 2), torch.randn(2, 4, 2, 2)
    mask = torch.tensor([[[[1.0, 0.0], [0.5, 0.0]]], [[[1.0, 1.0], [1.0, 1.0]]]])
    squared = (prediction - target) ** 2
    first = (squared[0, :, 0, 0].sum() + 0.5 * squared[0, :, 1, 0].sum()) / (4 * 1.5)
    second = squared[1].mean()
    assert torch.allclose(diffusion_mse(prediction, target, None, mask), (first + second) / 2)
    weights = torch.tensor([2.0, 0.5])
    assert torch.allclose(diffusion_mse(prediction, target, weights, mask),
                          (2.0 * first + 0.5 * second) / 2)
    # a pixel-sized mask is averaged down to the loss's size first (area average)
    big = mask.repeat_interleave(8, dim=2).repeat_interleave(8, dim=3)
    assert torch.allclose(masked_sample_mean(squared, big), torch.stack([first, second]))
    assert torch.equal(latent_mask(big, (2, 2)), mask)


def test_masked_out_pixels_give_no_gradient():
    torch.manual_seed(0)
    layer = torch.nn.Conv2d(4, 4, 1)
    inputs, target = torch.randn(2, 4, 4, 4), torch.randn(2, 4, 4, 4)
    mask = torch.ones(2, 1, 4, 4)
    mask[0, :, :, 2:] = 0  # the right half of sample 0 is left out
    mask[1] = 0            # sample 1 is left out entirely

    def gradient(target):
        layer.zero_grad()
        diffusion_mse(layer(inputs), target, None, mask).backward()
        return layer.weight.grad.clone(), layer.bias.grad.clone()

    before = gradient(target)
    changed = target.clone()
    changed[0, :, :, 2:] += 100.0  # only masked-out pixels change
    changed[1] -= 50.0
    after = gradient(changed)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    layer.zero_grad()
    diffusion_mse(layer(inputs[1:]), target[1:], None, mask[1:]).backward()
    assert torch.count_nonzero(layer.weight.grad) == 0 and torch.count_nonzero(layer.bias.grad) == 0


def half_red(path: Path, size=(96, 64), mask: bool = True, alpha: bool = False) -> Path:
    """An image red on its left third, blue elsewhere; the mask (a file, or the alpha channel)
    keeps the red part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    width, height = size
    image = Image.new("RGBA" if alpha else "RGB", size, (0, 0, 255, 0) if alpha else (0, 0, 255))
    image.paste((255, 0, 0, 255) if alpha else (255, 0, 0), (0, 0, width // 3, height))
    image.save(path)
    if mask:
        keep = Image.new("L", size, 0)
        keep.paste(255, (0, 0, width // 3, height))
        keep.save(path.with_name(path.stem + "_mask.png"))
    return path


@pytest.mark.parametrize("alpha", [False, True])
def test_the_mask_follows_the_images_crop_and_flip(tmp_path, alpha):
    image = half_red(tmp_path / "a.png", mask=not alpha, alpha=alpha)
    mask_file = None if alpha else tmp_path / "a_mask.png"
    flipped = set()
    for seed in range(12):
        prepared, mask = load_masked_sample(image, mask_file, alpha, (64, 64), False, True,
                                            random.Random(seed))
        red = (prepared.pixels[0] > 0) & (prepared.pixels[2] < 0)
        assert mask.shape == (1, 64, 64)
        # away from the red/blue edge (resampling blurs a pixel or two) mask == red
        agree = (mask[0] > 0.5) == red
        assert agree.float().mean() > 0.97, seed
        flipped.add(prepared.flipped)
    assert flipped == {False, True}


def test_a_scan_pairs_masks_and_alpha_and_never_trains_a_mask(tmp_path):
    half_red(tmp_path / "filed.png")
    half_red(tmp_path / "transparent.png", mask=False, alpha=True)
    half_red(tmp_path / "plain.png", mask=False)
    Image.new("RGB", (8, 8)).save(tmp_path / "lonely_mask.png")  # no lonely.*: an image
    scan = scan_datasets([DatasetSource(tmp_path)], check_masks=True)
    by_name = {item.path.name: item for item in scan.items}
    assert sorted(by_name) == ["filed.png", "lonely_mask.png", "plain.png", "transparent.png"]
    assert by_name["filed.png"].mask == tmp_path / "filed_mask.png"
    assert by_name["transparent.png"].alpha and by_name["transparent.png"].mask is None
    assert by_name["plain.png"].mask is None and not by_name["plain.png"].alpha
    dataset = ImageCaptionDataset(expand_repeats(scan), 64, masked_loss=True)
    batch = collate_examples([dataset[i] for i in range(len(dataset))])
    masks = {Path(p).name: m for p, m in zip(batch["path"], batch["mask"])}
    assert torch.equal(masks["plain.png"], torch.ones(1, 64, 64))
    for name in ("filed.png", "transparent.png"):
        assert 0.2 < masks[name].mean() < 0.45  # about the left third of the center crop


def test_bad_mask_files_are_refused_by_name(tmp_path):
    half_red(tmp_path / "a.png", mask=False)
    Image.new("L", (10, 10), 255).save(tmp_path / "a_mask.png")
    half_red(tmp_path / "b.png", mask=False)
    (tmp_path / "b_mask.png").write_bytes(b"not a png")
    with pytest.raises(DatasetError) as error:
        scan_datasets([DatasetSource(tmp_path)], check_masks=True)
    message = str(error.value)
    assert "a_mask.png: 10x10 pixels, but its image is 96x64" in message
    assert "b_mask.png: unreadable" in message
    scan_datasets([DatasetSource(tmp_path)])  # masked loss off: masks are not opened


def fake_encode(pixels: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(pixels, 8).repeat(1, 2, 1, 1)[:, :4]


def test_the_latent_cache_stores_the_mask_with_the_latent(tmp_path):
    half_red(tmp_path / "data" / "filed.png")
    half_red(tmp_path / "data" / "plain.png", size=(90, 60), mask=False)  # other bytes
    scan = scan_datasets([DatasetSource(tmp_path / "data")], check_masks=True)
    cache = LatentCache(tmp_path / "cache", "vae")
    stats = cache_latents(scan.items, fake_encode, cache, 64, random_flip=True,
                          masked_loss=True)
    filed, plain = (stats.entries[(tmp_path / "data" / n, (64, 64))]
                    for n in ("filed.png", "plain.png"))
    assert filed.masked and not plain.masked
    for flip, key in filed.keys.items():
        entry = cache.get_entry(key, require_mask=True)
        _, full = load_masked_sample(tmp_path / "data" / "filed.png",
                                     tmp_path / "data" / "filed_mask.png", False, 64, True,
                                     False, None)
        expected = latent_mask(full.unsqueeze(0), (8, 8))[0]
        assert torch.allclose(entry.mask, expected.flip(-1) if flip else expected)
    # an image without a mask keeps the key (and file) an unmasked run uses
    unmasked = cache_latents(scan.items, fake_encode, cache, 64, random_flip=True)
    assert unmasked.entries[(tmp_path / "data" / "plain.png", (64, 64))].keys == plain.keys
    assert unmasked.entries[(tmp_path / "data" / "filed.png", (64, 64))].keys != filed.keys
    assert unmasked.misses == 2 and unmasked.hits == 2  # filed.png re-encoded without its mask
    dataset = CachedLatentDataset(scan.items, stats.entries, cache, masked_loss=True)
    batch = collate_examples([dataset[0], dataset[1]])
    assert batch["mask"].shape == (2, 1, 8, 8)
    assert torch.equal(batch["mask"][1], torch.ones(1, 8, 8))


def test_an_entry_written_without_its_mask_is_not_served_to_a_masked_run(tmp_path):
    cache = LatentCache(tmp_path, "vae")
    key = latent_key("content", 64, True, (0, 0), False, "vae", mask="alpha")
    cache.put(key, torch.zeros(4, 8, 8))  # no mask stored under a masked key
    assert cache.get_entry(key) is not None
    assert cache.get_entry(key, require_mask=True) is None and cache.corrupt == 1


@pytest.mark.parametrize("cached", [False, True])
def test_a_masked_run_trains_and_reports_its_masks(tiny_config, tmp_path, cached):
    from modules.events import RecordingCallbacks
    from modules.train.trainer import train
    half_red(tmp_path / "data" / "filed.png")
    half_red(tmp_path / "data" / "transparent.png", mask=False, alpha=True)
    half_red(tmp_path / "data" / "plain.png", mask=False)
    callbacks = RecordingCallbacks()
    result = train(tiny_config(f"data.datasets[0].path={tmp_path / 'data'}",
                               "data.masked_loss=true", f"data.cache_latents={cached}",
                               "training.max_steps=2"), callbacks)
    record = json.loads((result.output_dir / "run.json").read_text())
    assert record["masked_loss"] == {"file": 1, "alpha": 1, "none": 1}
    assert all(loss is not None for loss in record["losses"]) and result.steps == 2
    assert any("1 have no mask and train on the whole image" in s for s in callbacks.statuses)
