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
from dataclasses import dataclass

from modules.config.data import DataConfig, source_resolutions
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


@dataclass(frozen=True)
class ResolutionPlan:
    """Every (image, resolution) sample of an epoch: `items[i]` trains at `target_sizes[i]`,
    its bucket (or square) within `resolutions[i]`'s pixel budget.

    Samples are ordered by resolution, then by item, so a run with one resolution has exactly
    the items, order and sizes it had before several resolutions existed (its sampler order,
    resume and cache keys unchanged).
    """
    items: list[ScanItem]
    target_sizes: list[Size]
    resolutions: list[int]

    @property
    def distinct(self) -> list[int]:
        """The resolutions trained, smallest first."""
        return sorted(set(self.resolutions))

    def table(self) -> list[dict]:
        """run.json's bucket table: per resolution its samples and items per bucket."""
        rows = []
        for resolution in self.distinct:
            sizes = [s for s, r in zip(self.target_sizes, self.resolutions) if r == resolution]
            rows.append({"resolution": resolution, "items": len(sizes),
                         "sizes": bucket_counts(sizes)})
        return rows

    def shape_sets(self, batch_size: int, world_size: int = 1) -> dict[int, list[tuple[int, int, int]]]:
        """Per resolution, the (batch, height, width) shapes its batches have
        (`batch_shapes`): what the compiled denoiser meets."""
        return {r: batch_shapes([s for s, res in zip(self.target_sizes, self.resolutions)
                                 if res == r], batch_size, world_size)
                for r in self.distinct}

    def describe(self) -> str:
        """One status line per resolution: its buckets and their item counts."""
        return "; ".join(f"{row['resolution']} px: "
                         + describe_buckets([s for s, r in zip(self.target_sizes,
                                                                self.resolutions)
                                             if r == row["resolution"]])
                         for row in self.table())


def plan_resolutions(items: Sequence[ScanItem], source_resolutions: Sequence[Sequence[int]],
                     aspect_buckets: bool, max_aspect: float) -> ResolutionPlan:
    """Each item at each resolution its source (dataset) lists (`source_resolutions[i]` for
    dataset i): its aspect bucket within that resolution with `aspect_buckets`, else that
    resolution's square."""
    every = sorted({r for listed in source_resolutions for r in listed})
    plan = ResolutionPlan([], [], [])
    for resolution in every:
        chosen = [item for item in items if resolution in source_resolutions[item.source_index]]
        sizes = (assign_buckets(chosen, resolution, max_aspect) if aspect_buckets
                 else [(resolution, resolution)] * len(chosen))
        plan.items.extend(chosen)
        plan.target_sizes.extend(sizes)
        plan.resolutions.extend([resolution] * len(chosen))
    return plan


def resolution_plan(data: DataConfig, items: Sequence[ScanItem]) -> ResolutionPlan:
    """`plan_resolutions` with the data section's resolutions (its datasets' own lists)."""
    return plan_resolutions(items, source_resolutions(data), data.aspect_buckets,
                            data.bucket_max_aspect)


def batch_shapes(target_sizes: Sequence[Size], batch_size: int,
                 world_size: int = 1) -> list[tuple[int, int, int]]:
    """Every (batch, height, width) a bucket batch sampler over these sizes yields, sorted:
    each bucket's full batches and its short last one (`BucketBatchSampler`'s arithmetic).
    The shape sets a compiled denoiser meets; one per bucket and batch length."""
    shapes = set()
    for (height, width), count in Counter((h, w) for h, w in target_sizes).items():
        share = -(-count // world_size)
        shapes.add((min(batch_size, share), height, width))
        if share % batch_size and share > batch_size:
            shapes.add((share % batch_size, height, width))
    return sorted(shapes)
