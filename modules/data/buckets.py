"""Aspect-ratio buckets: the sizes a resolution allows, and the one each image trains at.

Cropping every image to a centre square cuts the top off portraits and the sides off
landscapes, and teaches the model that subjects are always cut off. Buckets (kohya's and
OneTrainer's "aspect ratio bucketing") give each image the size nearest its own shape, with
about the pixel count of the `resolution` square, so every bucket costs about the same per
step. A batch only ever holds images of one bucket (`BucketBatchSampler` in dataset.py), so it
stacks into one tensor.

Sizes are (height, width) in pixels everywhere, like `original_size`; which sizes a resolution
allows is modules/geometry.py. Everything here is a pure function of sizes; no image is decoded.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from modules.data.folders import ScanItem
from modules.geometry import Size, aspect_of, bucket_sizes


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


def bucket_counts(target_sizes: Sequence[Size]) -> list[dict[str, int]]:
    """How many items train at each size, widest first: the record's and the log's summary."""
    counts = Counter((h, w) for h, w in target_sizes)
    return [{"height": h, "width": w, "items": counts[(h, w)]}
            for h, w in sorted(counts, key=aspect_of)]


def describe_buckets(target_sizes: Sequence[Size]) -> str:
    """One status line, e.g. "3 buckets (height x width): 192x320: 4, 256x256: 6, 320x192: 2"."""
    rows = bucket_counts(target_sizes)
    listed = ", ".join(f"{r['height']}x{r['width']}: {r['items']}" for r in rows)
    return f"{len(rows)} bucket(s) in use (height x width: items): {listed}"
