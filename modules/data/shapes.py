"""The built-in demo dataset: generated pictures of one coloured shape on a plain background.

Clean, large, solid shapes with short captions ("a red circle on a blue background") are easy
for a tiny model to learn, so the demo shows a falling loss and recognisable samples within
minutes on a CPU. The set is generated from a fixed seed and is byte-identical every time.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from PIL import Image, ImageDraw

from modules.model_types import BUILTIN_SHAPES
from modules.util.atomic import publish_dir_once

DATASET_VERSION = "v1"
SEED = 1234
SHAPES = ("circle", "square", "triangle")
FOREGROUND_COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
    "yellow": (240, 210, 40), "purple": (140, 60, 180), "orange": (245, 140, 30),
}
BACKGROUND_COLORS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245), "black": (20, 20, 20), "gray": (128, 128, 128),
    "pink": (250, 180, 200),
}
# Shapes are drawn this many times larger and downscaled, for smooth (anti-aliased) edges.
SUPERSAMPLE = 4
# Shape size as a fraction of the image side, and the largest centre offset, also a fraction.
SIZE_RANGE = (0.5, 0.7)
MAX_OFFSET = 0.1


def shape_caption(shape: str, color: str, background: str) -> str:
    """The caption of one image, e.g. "a red circle on a blue background"."""
    return f"a {color} {shape} on a {background} background"


def _shape_points(shape: str, cx: float, cy: float, half: float) -> list[tuple[float, float]]:
    """The bounding box (circle, square) or corners (triangle, pointing up) of a shape."""
    if shape == "triangle":
        # Taller and wider than the box so its area is closer to the circle's and square's.
        return [(cx, cy - 1.1 * half), (cx + 1.15 * half, cy + 0.95 * half),
                (cx - 1.15 * half, cy + 0.95 * half)]
    return [(cx - half, cy - half), (cx + half, cy + half)]


def draw_shape(shape: str, color: tuple[int, int, int], background: tuple[int, int, int],
               size: int, rng: random.Random) -> Image.Image:
    """One `size` x `size` RGB image of `shape`, with a little random size/position jitter."""
    big = size * SUPERSAMPLE
    image = Image.new("RGB", (big, big), background)
    half = big * rng.uniform(*SIZE_RANGE) / 2
    cx = big / 2 + big * rng.uniform(-MAX_OFFSET, MAX_OFFSET)
    cy = big / 2 + big * rng.uniform(-MAX_OFFSET, MAX_OFFSET)
    points = _shape_points(shape, cx, cy, half)
    draw = ImageDraw.Draw(image)
    drawers: dict[str, Callable[[], None]] = {
        "circle": lambda: draw.ellipse(points, fill=color),
        "square": lambda: draw.rectangle(points, fill=color),
        "triangle": lambda: draw.polygon(points, fill=color),
    }
    drawers[shape]()
    return image.resize((size, size), Image.Resampling.LANCZOS)


def shape_combinations(count: int, seed: int = SEED) -> list[tuple[str, str, str]]:
    """`count` (shape, colour, background) triples, cycling through a shuffled full set.

    Cycling the shuffled set spreads every combination evenly before any repeats.
    """
    combos = [(s, c, b) for s in SHAPES for c in FOREGROUND_COLORS for b in BACKGROUND_COLORS]
    random.Random(seed).shuffle(combos)
    return [combos[i % len(combos)] for i in range(count)]


def write_shapes(dest: Path, count: int, size: int, seed: int = SEED) -> None:
    """Write `count` PNG images and same-name .txt captions into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i, (shape, color, background) in enumerate(shape_combinations(count, seed)):
        image = draw_shape(shape, FOREGROUND_COLORS[color], BACKGROUND_COLORS[background],
                           size, rng)
        image.save(dest / f"{i:04d}.png", format="PNG", optimize=False)
        (dest / f"{i:04d}.txt").write_text(shape_caption(shape, color, background) + "\n",
                                          encoding="utf-8")


def shapes_dataset_dir(cache_dir: Path, count: int = 48, size: int = 64) -> Path:
    """Where the shapes dataset with these settings lives in `cache_dir`."""
    return Path(cache_dir) / "datasets" / f"shapes-{DATASET_VERSION}-{count}-{size}"


def builtin_dataset_identity(path: str) -> str | None:
    """What a generated shapes dataset *is*, read from its cache folder (`shapes_dataset_dir`):
    "builtin:shapes@<version>-<count>-<size>", the same in every cache folder; None for a path
    that is not one."""
    folder = Path(path)
    prefix = f"shapes-{DATASET_VERSION}-"
    count_size = folder.name.removeprefix(prefix).split("-")
    if (folder.parent.name != "datasets" or not folder.name.startswith(prefix)
            or len(count_size) != 2 or not all(part.isdigit() for part in count_size)):
        return None
    return f"{BUILTIN_SHAPES}@{folder.name.removeprefix('shapes-')}"


def ensure_shapes_dataset(cache_dir: Path, count: int = 48, size: int = 64) -> Path:
    """The folder of the generated shapes dataset, generating it on first use.

    The folder appears only once complete, so an interrupted run is redone next time.
    """
    if count < 1 or size < 8:
        raise ValueError(f"shapes dataset needs count >= 1 and size >= 8, got {count}, {size}")
    target = shapes_dataset_dir(cache_dir, count, size)
    if target.is_dir():
        return target
    return publish_dir_once(target, lambda tmp: write_shapes(tmp, count, size))


DATASET_BUILDERS: dict[str, Callable[[Path], Path]] = {BUILTIN_SHAPES: ensure_shapes_dataset}
