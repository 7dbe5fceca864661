"""The held-out split: deterministic from the seed and each file's identity, disjoint, and the
same wherever the dataset folder lives."""
from __future__ import annotations

from pathlib import Path

from modules.data.folders import DatasetSource, ScanItem, ScanResult
from modules.data.split import held_out_count, item_identity, split_items, without_items


def scan_of(root: Path, names_per_source: list[list[str]]) -> ScanResult:
    sources = tuple(DatasetSource(root / f"set{i}") for i in range(len(names_per_source)))
    items = [ScanItem(root / f"set{i}" / name, f"caption {name}", i)
             for i, names in enumerate(names_per_source) for name in names]
    return ScanResult(sources=sources, items=items,
                      images_per_source=[len(n) for n in names_per_source])


NAMES = [[f"img{i:02d}.png" for i in range(14)], [f"other{i}.jpg" for i in range(6)]]


def identities(scan: ScanResult, items) -> set[str]:
    return {item_identity(scan, item) for item in items}


def test_the_split_is_disjoint_complete_and_counted_half_up():
    scan = scan_of(Path("/data"), NAMES)
    train, held = split_items(scan, 0.25, seed=7)
    assert len(held) == held_out_count(20, 0.25) == 5
    assert identities(scan, train).isdisjoint(identities(scan, held))
    assert identities(scan, train) | identities(scan, held) == identities(scan, scan.items)
    assert [i for i in scan.items if i in train] == train  # the scan's order is kept
    assert held_out_count(10, 0.25) == 3 and held_out_count(3, 0.1) == 0


def test_the_same_images_are_held_out_wherever_the_folder_is_and_in_any_order():
    here = scan_of(Path("/data"), NAMES)
    moved = scan_of(Path("/elsewhere/copy"), NAMES)
    shuffled = scan_of(Path("/data"), NAMES)
    shuffled.items.reverse()
    held = identities(here, split_items(here, 0.3, seed=7)[1])
    assert identities(moved, split_items(moved, 0.3, seed=7)[1]) == held
    assert identities(shuffled, split_items(shuffled, 0.3, seed=7)[1]) == held
    # another seed picks another set (the choice depends on it)
    assert identities(here, split_items(here, 0.3, seed=8)[1]) != held


def test_adding_an_image_moves_at_most_that_image():
    before = scan_of(Path("/data"), NAMES)
    after = scan_of(Path("/data"), [NAMES[0] + ["img99.png"], NAMES[1]])
    held_before = identities(before, split_items(before, 0.25, seed=3)[1])
    held_after = identities(after, split_items(after, 0.25, seed=3)[1])
    # 20 -> 21 images: still 5 held out; the set changes by at most the new image
    assert len(held_before ^ held_after) <= 2
    assert held_after - held_before <= {"0:img99.png"}


def test_without_items_keeps_the_per_source_counts_true():
    scan = scan_of(Path("/data"), NAMES)
    train, _ = split_items(scan, 0.5, seed=1)
    kept = without_items(scan, train)
    assert kept.items == train and sum(kept.images_per_source) == len(train) == 10
    assert scan.num_images == 20  # the original scan is not changed


def test_class_images_are_never_held_out():
    import dataclasses
    scan = scan_of(Path("/data"), NAMES)
    scan = dataclasses.replace(scan, sources=(scan.sources[0],
                                              dataclasses.replace(scan.sources[1],
                                                                  regularization=True)))
    train, held = split_items(scan, 0.5, seed=7)
    assert len(held) == held_out_count(14, 0.5) == 7  # counted on the 14 training images
    assert all(item.source_index == 0 for item in held)
    assert sum(1 for item in train if item.source_index == 1) == 6
