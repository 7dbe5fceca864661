"""The held-out validation split: which scanned images are scored instead of trained.

The choice is a pure function of the seed and each image's identity (its dataset's place in
the list and its path inside that folder), never of the scan's order, the machine or the
folder's absolute location: the same images are held out on every run, every resume and
every process, and adding one image to a folder moves at most that image between the sides.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from modules.data.folders import ScanItem, ScanResult
from modules.data.seeds import derive_seed


def item_identity(scan: ScanResult, item: ScanItem) -> str:
    """"<dataset index>:<path inside the dataset folder>" (posix), the item's stable name."""
    folder = Path(scan.sources[item.source_index].path)
    try:
        inside = item.path.relative_to(folder).as_posix()
    except ValueError:  # an item made by hand outside its folder: its own name then
        inside = item.path.as_posix()
    return f"{item.source_index}:{inside}"


def held_out_count(images: int, ratio: float) -> int:
    """How many of `images` a `ratio` holds out (rounded half up: 0.25 of 10 is 3)."""
    return int(ratio * images + 0.5)


def split_items(scan: ScanResult, ratio: float, seed: int) -> tuple[list[ScanItem],
                                                                     list[ScanItem]]:
    """(training items, held-out items), both in the scan's order. The held-out ones are the
    `held_out_count` items whose derived rank (seed, identity) is smallest, among the training
    images: class images (a regularisation folder's) are never held out, since the score is of
    what the run is trained to learn."""
    candidates = splittable_items(scan)
    count = held_out_count(len(candidates), ratio)
    ranked = sorted(candidates, key=lambda item: (derive_seed("validation-split", seed,
                                                              item_identity(scan, item)),
                                                  item_identity(scan, item)))
    held = {id(item) for item in ranked[:count]}
    return ([item for item in scan.items if id(item) not in held],
            [item for item in scan.items if id(item) in held])


def splittable_items(scan: ScanResult) -> list[ScanItem]:
    """The items a validation split may hold out: those of folders that are not class images."""
    return [item for item in scan.items if not scan.sources[item.source_index].regularization]


def without_items(scan: ScanResult, kept: list[ScanItem]) -> ScanResult:
    """`scan` with only `kept` as its items (its per-source counts follow)."""
    per_source = [sum(1 for item in kept if item.source_index == i)
                  for i in range(len(scan.sources))]
    return dataclasses.replace(scan, items=list(kept), images_per_source=per_source)
