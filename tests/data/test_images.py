"""Loading one image: colour modes, EXIF orientation, resize, crop, flip, randomness."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modules.data.errors import DatasetError
from modules.data.images import (check_image, load_training_image, oriented_size, plan_crop,
                                 resized_size)

RES = 16


def save(image: Image.Image, path: Path, **kwargs) -> Path:
    image.save(path, **kwargs)
    return path


def half_red_half_blue(width: int, height: int) -> Image.Image:
    """Left half red, right half blue."""
    array = np.zeros((height, width, 3), dtype=np.uint8)
    array[:, : width // 2] = (255, 0, 0)
    array[:, width // 2:] = (0, 0, 255)
    return Image.fromarray(array)


def assert_rgb_tensor(pixels: torch.Tensor) -> None:
    assert pixels.shape == (3, RES, RES)
    assert pixels.dtype == torch.float32
    assert pixels.min() >= -1.0 and pixels.max() <= 1.0


def transparent_rgba() -> Image.Image:
    image = Image.new("RGBA", (24, 20), (255, 0, 0, 255))
    image.paste((0, 0, 0, 0), (0, 0, 24, 10))  # top half fully transparent (black RGB under it)
    return image


def transparent_palette() -> Image.Image:
    image = Image.new("P", (20, 20), 0)
    image.putpalette([0, 0, 0, 0, 255, 0] + [0] * (256 * 3 - 6))  # 0: black, 1: green
    image.paste(1, (0, 10, 20, 20))  # bottom half green
    image.info["transparency"] = 0  # black (the top half) is transparent
    return image


@pytest.mark.parametrize("name, image, top_expected", [
    ("rgba.png", transparent_rgba(), (1.0, 1.0, 1.0)),  # transparent -> white, not black
    ("la.png", Image.new("LA", (20, 30), (0, 0)), (1.0, 1.0, 1.0)),
    ("p_transparent.png", transparent_palette(), (1.0, 1.0, 1.0)),
    ("grey.png", Image.new("L", (30, 20), 255), (1.0, 1.0, 1.0)),
    ("cmyk.jpg", Image.new("CMYK", (20, 20), (0, 0, 0, 0)), (1.0, 1.0, 1.0)),
    ("palette.png", Image.new("P", (20, 20), 0), (-1.0, -1.0, -1.0)),
])
def test_every_mode_becomes_rgb_in_range(tmp_path: Path, name, image, top_expected) -> None:
    path = save(image, tmp_path / name)

    pixels = load_training_image(path, RES, center_crop=True, random_flip=False).pixels

    assert_rgb_tensor(pixels)
    assert torch.allclose(pixels[:, 0, 0], torch.tensor(top_expected), atol=0.02)


def test_transparent_image_keeps_opaque_colour(tmp_path: Path) -> None:
    pixels = load_training_image(save(transparent_rgba(), tmp_path / "a.png"), RES, True,
                                 False).pixels

    assert torch.allclose(pixels[:, -1, -1], torch.tensor([1.0, -1.0, -1.0]), atol=0.02)
    p_pixels = load_training_image(save(transparent_palette(), tmp_path / "p.png"), RES, True,
                                   False).pixels
    assert torch.allclose(p_pixels[:, -1, -1], torch.tensor([-1.0, 1.0, -1.0]), atol=0.02)


def test_sixteen_bit_greyscale_is_scaled_not_clipped(tmp_path: Path) -> None:
    values = np.full((20, 20), 32896, dtype=np.uint16)  # 128 * 257: mid grey
    values[10:] = 65535
    path = save(Image.fromarray(values), tmp_path / "g16.png")
    with Image.open(path) as reopened:
        assert reopened.mode.startswith("I")

    pixels = load_training_image(path, RES, center_crop=True, random_flip=False).pixels

    assert_rgb_tensor(pixels)
    assert torch.allclose(pixels[:, 0, 0], torch.full((3,), 128 / 127.5 - 1), atol=0.01)
    assert torch.allclose(pixels[:, -1, 0], torch.ones(3), atol=0.01)


def test_exif_orientation_is_honoured(tmp_path: Path) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    path = save(half_red_half_blue(64, 32), tmp_path / "rotated.jpg", exif=exif, quality=95)

    assert oriented_size(path) == (64, 32)
    image = load_training_image(path, 32, center_crop=True, random_flip=False)

    assert image.original_size == (64, 32)
    top, bottom = image.pixels[:, 0, 16], image.pixels[:, -1, 16]
    assert top[0] > 0.8 and top[2] < -0.8  # red on top: the stored left edge
    assert bottom[2] > 0.8 and bottom[0] < -0.8


def test_resize_short_side_and_center_crop(tmp_path: Path) -> None:
    path = save(half_red_half_blue(80, 40), tmp_path / "wide.png")

    image = load_training_image(path, 20, center_crop=True, random_flip=False)

    assert resized_size(40, 80, 20) == (20, 40)
    assert image.original_size == (40, 80)
    assert image.crop_top_left == (0, 10)
    assert image.pixels[0, 10, 0] > 0.8 and image.pixels[2, 10, -1] > 0.8  # red | blue centre


def test_random_crop_is_reproducible_and_uses_only_the_given_rng(tmp_path: Path) -> None:
    path = save(Image.effect_noise((120, 40), 80).convert("RGB"), tmp_path / "noise.png")

    def crop(rng) -> tuple[int, int]:
        return load_training_image(path, RES, center_crop=False, random_flip=False,
                                   rng=rng).crop_top_left

    random.seed(0)
    first = [crop(random.Random(seed)) for seed in range(20)]
    random.seed(123)  # the global RNG must not matter
    assert [crop(random.Random(seed)) for seed in range(20)] == first
    assert len(set(first)) > 1
    assert crop(torch.Generator().manual_seed(3)) == crop(torch.Generator().manual_seed(3))
    assert all(top == 0 and 0 <= left <= 48 - RES for top, left in first)


def test_flip_mirrors_pixels_and_crop_position(tmp_path: Path) -> None:
    path = save(Image.effect_noise((48, 16), 80).convert("RGB"), tmp_path / "noise.png")
    rng_seeds = range(40)
    results = [load_training_image(path, RES, center_crop=False, random_flip=True,
                                   rng=random.Random(s)) for s in rng_seeds]
    again = [load_training_image(path, RES, center_crop=False, random_flip=True,
                                 rng=random.Random(s)) for s in rng_seeds]

    assert [r.flipped for r in results] == [r.flipped for r in again]
    assert {r.flipped for r in results} == {True, False}
    flipped = next(r for r in results if r.flipped)
    top, left = plan_crop((16, 48), RES, False, random.Random(rng_seeds[results.index(flipped)]))
    plain = load_training_image(path, RES, center_crop=True, random_flip=False)
    assert flipped.crop_top_left == (top, 48 - RES - left)
    with Image.open(path) as source:
        crop_array = np.array(source.crop((left, top, left + RES, top + RES)))
    unflipped_same_crop = torch.from_numpy(crop_array).permute(2, 0, 1).float() / 127.5 - 1
    assert torch.allclose(flipped.pixels, unflipped_same_crop.flip(-1))
    assert plain.crop_top_left == (0, 16)


def test_random_choices_need_an_rng(tmp_path: Path) -> None:
    path = save(Image.new("RGB", (20, 20)), tmp_path / "a.png")

    with pytest.raises(ValueError, match="rng"):
        load_training_image(path, RES, center_crop=False, random_flip=False)
    with pytest.raises(ValueError, match="rng"):
        load_training_image(path, RES, center_crop=True, random_flip=True)


def test_check_image_and_load_name_a_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)

    assert check_image(bad) is not None
    with pytest.raises(DatasetError, match="bad.png"):
        load_training_image(bad, RES, center_crop=True, random_flip=False)
