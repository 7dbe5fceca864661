"""The generated shapes dataset: layout, captions, determinism, learnable images, caching."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modules.config.schema import BUILTIN_SHAPES
from modules.data import shapes


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_layout_and_captions(tmp_path):
    folder = shapes.ensure_shapes_dataset(tmp_path, count=12, size=64)
    assert folder == tmp_path / "datasets" / "shapes-v1-12-64"
    pngs = sorted(folder.glob("*.png"))
    assert len(pngs) == 12 and len(list(folder.glob("*.txt"))) == 12
    for png in pngs:
        image = Image.open(png)
        assert image.size == (64, 64) and image.mode == "RGB"
        caption = png.with_suffix(".txt").read_text(encoding="utf-8").strip()
        words = caption.split()
        assert words[0] == "a" and words[3:5] == ["on", "a"] and words[-1] == "background"
        assert words[1] in shapes.FOREGROUND_COLORS and words[2] in shapes.SHAPES
        assert words[5] in shapes.BACKGROUND_COLORS


def test_byte_identical_every_time(tmp_path):
    first = shapes.ensure_shapes_dataset(tmp_path / "a", count=10, size=32)
    second = shapes.ensure_shapes_dataset(tmp_path / "b", count=10, size=32)
    assert _files(first) == _files(second)


def test_images_show_their_caption(tmp_path):
    """Corners are the background colour and the centre is the shape's colour, as captioned."""
    folder = shapes.ensure_shapes_dataset(tmp_path, count=24, size=64)
    for png in sorted(folder.glob("*.png")):
        _, color, shape, _, _, background, _ = png.with_suffix(".txt").read_text().split()
        pixels = np.asarray(Image.open(png), dtype=int)
        corner = pixels[1, 1]
        assert np.abs(corner - shapes.BACKGROUND_COLORS[background]).max() <= 3, png.name
        center = pixels[32, 32]
        assert np.abs(center - shapes.FOREGROUND_COLORS[color]).max() <= 3, png.name
        # Large enough to learn: the shape covers a good share of the picture.
        is_shape = np.abs(pixels - shapes.FOREGROUND_COLORS[color]).max(axis=-1) <= 10
        assert 0.1 < is_shape.mean() < 0.6, (png.name, shape, is_shape.mean())


def test_combinations_cover_everything_before_repeating():
    total = len(shapes.SHAPES) * len(shapes.FOREGROUND_COLORS) * len(shapes.BACKGROUND_COLORS)
    combos = shapes.shape_combinations(total)
    assert len(set(combos)) == total
    assert shapes.shape_combinations(total + 5)[total:] == combos[:5]


def test_reused_when_present(tmp_path, monkeypatch):
    folder = shapes.ensure_shapes_dataset(tmp_path, count=6, size=32)
    mtime = (folder / "0000.png").stat().st_mtime_ns

    def no_rewrite(*args, **kwargs):
        raise AssertionError("the cached dataset was regenerated")

    monkeypatch.setattr(shapes, "write_shapes", no_rewrite)
    assert shapes.ensure_shapes_dataset(tmp_path, count=6, size=32) == folder
    assert (folder / "0000.png").stat().st_mtime_ns == mtime


def test_interrupted_generation_leaves_no_finished_folder(tmp_path, monkeypatch):
    real_write = shapes.write_shapes

    def write_then_fail(dest, count, size, seed=shapes.SEED):
        real_write(dest, count, size, seed)
        raise KeyboardInterrupt

    monkeypatch.setattr(shapes, "write_shapes", write_then_fail)
    with pytest.raises(KeyboardInterrupt):
        shapes.ensure_shapes_dataset(tmp_path, count=4, size=32)
    assert list((tmp_path / "datasets").iterdir()) == []


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="count"):
        shapes.ensure_shapes_dataset(tmp_path, count=0)


def test_builtin_mapping():
    assert shapes.DATASET_BUILDERS[BUILTIN_SHAPES] is shapes.ensure_shapes_dataset
