"""Aspect-ratio buckets: the sizes a resolution allows, and the one each image trains at.

Cropping every image to a centre square cuts the top off portraits and the sides off
landscapes, and teaches the model that subjects are always cut off. Buckets (kohya's and
OneTrainer's "aspect ratio bucketing") give each image the size nearest its own shape, with
about the pixel count of the `resolution` square, so every bucket costs about the same per
step. A batch only ever holds images of one bucket (`BucketBatchSampler` in dataset.py), so it
stacks into one tensor.

Sizes are (height, width) in pixels everywhere, like `original_size`. Everything here is a
pure function of sizes; no image is decoded.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from modules.data.folders import ScanItem

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


def nearest_bucket(size: Size, buckets: Sequence[Size]) -> Size:
    """The bucket whose aspect ratio is nearest `size`'s, measured in log space.

    Log space makes 1:2 and 2:1 equally far from 1:1. Ties go to the first bucket in `buckets`
    (the wider one, in `bucket_sizes` order).
    """
    if not buckets:
        raise ValueError("no buckets to choose from")
    height, width = size
    if height < 1 or width < 1:
        raise ValueError(f"an image size must be positive, got {height}x{width}")
    log_aspect = math.log(height / width)
    return min(buckets, key=lambda bucket: abs(math.log(aspect_of(bucket)) - log_aspect))


def assign_buckets(items: Sequence[ScanItem], resolution: int, max_aspect: float) -> list[Size]:
    """The bucket of every item, in item order (an image's repeats share its bucket)."""
    buckets = bucket_sizes(resolution, max_aspect)
    return [nearest_bucket(item.oriented_size(), buckets) for item in items]


def narrowest_non_square(resolution: int, step: int = BUCKET_STEP) -> float | None:
    """The smallest long/short ratio of a non-square bucket at `resolution` (None: only the
    square fits). Tells a user whose bucket list is just the square what would change that."""
    widest = (resolution / step) ** 2  # a step-wide bucket with the square's area
    sizes = bucket_sizes(resolution, max_aspect=widest, step=step)
    ratios = [aspect_of(size) for size in sizes if aspect_of(size) > 1.0]
    return min(ratios) if ratios else None


def bucket_counts(target_sizes: Sequence[Size]) -> list[dict[str, int]]:
    """How many items train at each size, widest first: the record's and the log's summary."""
    counts = Counter(tuple(size) for size in target_sizes)
    return [{"height": h, "width": w, "items": counts[(h, w)]}
            for h, w in sorted(counts, key=aspect_of)]


def describe_buckets(target_sizes: Sequence[Size]) -> str:
    """One status line, e.g. "3 buckets (height x width): 192x320: 4, 256x256: 6, 320x192: 2"."""
    rows = bucket_counts(target_sizes)
    listed = ", ".join(f"{r['height']}x{r['width']}: {r['items']}" for r in rows)
    return f"{len(rows)} bucket(s) in use (height x width: items): {listed}"
