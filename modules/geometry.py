"""Bucket geometry: the (height, width) sizes a resolution allows, as pure functions of sizes.

At the bottom of the engine, beside the model-type table, because both config validation
(a bucket setting that only allows the square is reported before a run) and the data layer
(modules/data/buckets.py assigns each image its bucket) read it, and config sits below data.
"""
from __future__ import annotations

Size = tuple[int, int]  # (height, width) in pixels

# Bucket sides are multiples of 64, the rule `data.resolution` follows: SD latents are 1/8 of
# the image and the UNet halves them three times, so every UNet level keeps a whole size.
BUCKET_STEP = 64


def aspect_of(size: Size) -> float:
    """height / width: below 1 for landscape, above 1 for portrait."""
    height, width = size
    return height / width


def bucket_sizes(resolution: int, max_aspect: float, step: int = BUCKET_STEP) -> list[Size]:
    """Every bucket for `resolution`, from the widest to the tallest.

    For each width `w` (a multiple of `step` up to `resolution`) the height is the largest
    multiple of `step` with `h * w <= resolution**2`; the pair is kept when `h >= w` and
    `h / w <= max_aspect`, and mirrored into its landscape twin. So no bucket has more pixels
    than the square, the set is symmetric, and the square (resolution, resolution) is always in
    it. At 1024 and max aspect 2 these are SDXL's familiar nine, 768x1344 to 1344x768, each with
    0.96 to 1.0 of the square's area; at 512, five (384x640 to 640x384).
    """
    if resolution < step or resolution % step:
        raise ValueError(f"resolution must be a positive multiple of {step}, got {resolution}")
    if max_aspect < 1.0:
        raise ValueError(f"max_aspect must be at least 1.0, got {max_aspect}")
    area = resolution * resolution
    portraits = []
    for width in range(step, resolution + 1, step):
        height = area // width // step * step
        if width <= height <= max_aspect * width:
            portraits.append((height, width))
    every = set(portraits) | {(width, height) for height, width in portraits}
    return sorted(every, key=aspect_of)


def narrowest_non_square(resolution: int, step: int = BUCKET_STEP) -> float | None:
    """The smallest long/short ratio of a non-square bucket at `resolution` (None: only the
    square fits). Tells a user whose bucket list is just the square what would change that."""
    widest = (resolution / step) ** 2  # a step-wide bucket with the square's area
    sizes = bucket_sizes(resolution, max_aspect=widest, step=step)
    ratios = [aspect_of(size) for size in sizes if aspect_of(size) > 1.0]
    return min(ratios) if ratios else None
