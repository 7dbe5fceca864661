"""The image/caption dataset, repeats, per-(seed, epoch, index) randomness and the DataLoader."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from modules.data.dataset import (BucketBatchSampler, EpochShuffleSampler, ImageCaptionDataset,
                                  build_dataloader, collate_examples, epoch_batch_sampler,
                                  epoch_dataloader, expand_repeats, set_sampler_epoch)
from modules.data.folders import DatasetSource, scan_datasets

RES = 16


def make_folder(folder: Path, count: int, size=(40, 24)) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        Image.effect_noise(size, 60 + i).convert("RGB").save(folder / f"img{i:02d}.png")
        (folder / f"img{i:02d}.txt").write_text(f"caption {folder.name} {i}", encoding="utf-8")
    return folder


def make_dataset(tmp_path: Path, count: int = 5, seed: int = 7, **kwargs) -> ImageCaptionDataset:
    scan = scan_datasets([DatasetSource(make_folder(tmp_path / "set", count))])
    options = {"center_crop": False, "random_flip": True} | kwargs
    return ImageCaptionDataset(expand_repeats(scan), RES, seed=seed, **options)


def test_repeats_expand_the_items(tmp_path: Path) -> None:
    scan = scan_datasets([DatasetSource(make_folder(tmp_path / "a", 2), repeats=3),
                          DatasetSource(make_folder(tmp_path / "b", 1), repeats=1)])

    items = expand_repeats(scan)

    assert len(items) == 7 == scan.num_samples_per_epoch
    assert [i.path.name for i in items].count("img00.png") == 4  # 3 from a, 1 from b
    assert len(ImageCaptionDataset(items, RES)) == 7


def test_item_has_pixels_caption_and_sizes(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path, center_crop=True, random_flip=False)

    item = dataset[1]

    assert item["pixel_values"].shape == (3, RES, RES)
    assert item["caption"] == "caption set 1"
    assert item["path"].endswith("img01.png")
    assert item["original_size"] == (24, 40)
    assert item["crop_top_left"] == (0, (round(40 * RES / 24) - RES) // 2)


def test_items_depend_only_on_seed_epoch_and_index(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path, seed=7)
    same_seed = ImageCaptionDataset(dataset.items, RES, center_crop=False, random_flip=True,
                                    seed=7)

    def crops(ds, epoch):
        return [(ds[(epoch, i)]["crop_top_left"], ds[(epoch, i)]["pixel_values"].sum().item())
                for i in range(len(ds))]

    assert crops(dataset, 0) == crops(same_seed, 0)
    assert dataset[3]["crop_top_left"] == dataset[(0, 3)]["crop_top_left"]
    epochs = [crops(dataset, epoch) for epoch in range(4)]
    assert len({tuple(e) for e in epochs}) > 1  # a new crop/flip in a later epoch
    torch.manual_seed(0)  # global RNG must not matter
    assert crops(dataset, 2) == epochs[2]


def test_sampler_shuffles_per_epoch_and_can_be_rewound() -> None:
    sampler = EpochShuffleSampler(10, seed=1)

    first, second = list(sampler), list(sampler)
    sampler.set_epoch(0)

    assert [e for e, _ in first] == [0] * 10 and [e for e, _ in second] == [1] * 10
    assert sorted(i for _, i in first) == list(range(10))
    assert [i for _, i in first] != [i for _, i in second]
    assert list(sampler) == first
    assert [i for _, i in EpochShuffleSampler(10, seed=2)] != [i for _, i in first]
    assert [i for _, i in EpochShuffleSampler(4, seed=1, shuffle=False)] == [0, 1, 2, 3]


def test_collate_stacks_tensors_and_sizes(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path)

    batch = collate_examples([dataset[0], dataset[1], dataset[2]])

    assert batch["pixel_values"].shape == (3, 3, RES, RES)
    assert batch["caption"] == ["caption set 0", "caption set 1", "caption set 2"]
    assert batch["original_size"].tolist() == [[24, 40]] * 3
    assert batch["crop_top_left"].shape == (3, 2) and batch["crop_top_left"].dtype == torch.long


def run_epochs(loader, epochs: int) -> list[tuple[list[str], torch.Tensor]]:
    return [(batch["path"], batch["pixel_values"]) for _ in range(epochs) for batch in loader]


def test_dataloader_is_reproducible_from_the_seed(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path, count=5)

    first = run_epochs(build_dataloader(dataset, batch_size=2, seed=3), 2)
    again = run_epochs(build_dataloader(dataset, batch_size=2, seed=3), 2)
    other = run_epochs(build_dataloader(dataset, batch_size=2, seed=4), 2)

    assert len(first) == 6  # 3 batches of 2, 2, 1 per epoch: the last partial batch is kept
    assert [len(paths) for paths, _ in first[:3]] == [2, 2, 1]
    assert all(p1 == p2 and torch.equal(x1, x2) for (p1, x1), (p2, x2) in zip(first, again))
    assert [p for p, _ in first] != [p for p, _ in other]
    assert [p for p, _ in first[:3]] != [p for p, _ in first[3:]]  # epoch 2 reshuffled
    resumed = run_epochs(build_dataloader(dataset, batch_size=2, seed=3, start_epoch=1), 1)
    assert all(p1 == p2 and torch.equal(x1, x2) for (p1, x1), (p2, x2) in zip(first[3:], resumed))


def test_one_batch_sampler_serves_every_epoch_as_a_fresh_one_would(tmp_path: Path) -> None:
    """A run builds its batch sampler once (its length is the step budget) and sets each
    epoch on it: the batches are those of a loader built for that epoch, resume included."""
    dataset = make_dataset(tmp_path, count=5)
    batches = epoch_batch_sampler(len(dataset), 2, 3)

    for epoch, skip in ((1, 0), (0, 0), (1, 2)):
        set_sampler_epoch(batches, epoch)
        once = run_epochs(epoch_dataloader(dataset, batches, seed=3, skip_batches=skip), 1)
        fresh = run_epochs(build_dataloader(dataset, batch_size=2, seed=3, start_epoch=epoch,
                                            skip_batches=skip), 1)
        assert [p for p, _ in once] == [p for p, _ in fresh] and len(once) == 3 - skip


def test_workers_give_the_same_batches_as_the_main_process(tmp_path: Path) -> None:
    dataset = make_dataset(tmp_path, count=4)

    main = run_epochs(build_dataloader(dataset, batch_size=2, seed=5, num_workers=0), 2)
    workers = run_epochs(build_dataloader(dataset, batch_size=2, seed=5, num_workers=2), 2)

    assert all(p1 == p2 and torch.equal(x1, x2) for (p1, x1), (p2, x2) in zip(main, workers))
    assert len(workers) == 4


# -- aspect-ratio buckets: one bucket per batch, deterministic, sharded -----------------------

BUCKETS = ["wide"] * 5 + ["square"] * 2 + ["tall"] * 4  # one bucket key per item


def bucket_of(batch: list[tuple[int, int]]) -> set[str]:
    return {BUCKETS[index] for _, index in batch}


def test_bucket_sampler_gives_one_bucket_per_batch_and_every_item_once() -> None:
    sampler = BucketBatchSampler(BUCKETS, batch_size=2, seed=1)

    batches = list(sampler)

    assert all(len(bucket_of(batch)) == 1 for batch in batches)
    assert sorted(i for batch in batches for _, i in batch) == list(range(len(BUCKETS)))
    assert len(batches) == len(sampler) == 3 + 1 + 2  # wide 2+2+1, square 2, tall 2+2
    assert sampler.short_batches() == 1
    assert sorted(len(b) for b in batches) == [1, 2, 2, 2, 2, 2]
    assert {e for batch in batches for e, _ in batch} == {0}


def test_bucket_sampler_is_a_function_of_seed_and_epoch() -> None:
    sampler = BucketBatchSampler(BUCKETS, batch_size=2, seed=1)

    first, second = list(sampler), list(sampler)
    sampler.set_epoch(0)

    assert {e for batch in second for e, _ in batch} == {1}
    assert list(sampler) == first
    assert list(BucketBatchSampler(BUCKETS, batch_size=2, seed=1, start_epoch=1)) == second
    indices = [[i for _, i in batch] for batch in first]
    assert indices != [[i for _, i in batch] for batch in second]  # reshuffled
    assert indices != [[i for _, i in b] for b in BucketBatchSampler(BUCKETS, 2, seed=2)]
    # buckets are interleaved, not trained one after another
    orders = {tuple(sorted(bucket_of(b))[0] for b in BucketBatchSampler(BUCKETS, 2, seed=s))
              for s in range(10)}
    assert len(orders) > 1
    plain = BucketBatchSampler(BUCKETS, batch_size=2, seed=1, shuffle=False)
    assert [[i for _, i in b] for b in plain] == [[0, 1], [2, 3], [4], [5, 6], [7, 8], [9, 10]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_bucket_sampler_shards_ranks_evenly_and_in_step(world_size: int) -> None:
    ranks = [BucketBatchSampler(BUCKETS, batch_size=2, seed=4, rank=r, world_size=world_size)
             for r in range(world_size)]

    per_rank = [list(sampler) for sampler in ranks]

    assert len({len(batches) for batches in per_rank}) == 1
    assert all(len(batches) == len(ranks[0]) for batches in per_rank)
    for step in zip(*per_rank):  # every rank trains the same bucket and batch size at a step
        assert len({frozenset(bucket_of(batch)) for batch in step}) == 1
        assert len({len(batch) for batch in step}) == 1
    seen = {i for batches in per_rank for batch in batches for _, i in batch}
    assert seen == set(range(len(BUCKETS)))  # padding repeats items, never drops one


def test_bucketed_dataloader_stacks_one_size_per_batch_and_counts_batches(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    for i, size in enumerate([(40, 24), (40, 24), (24, 40), (30, 30), (40, 24)]):
        Image.effect_noise(size, 70 + i).convert("RGB").save(folder / f"img{i}.png")
    items = expand_repeats(scan_datasets([DatasetSource(folder)]))
    sizes = [(16, 32) if item.size[0] < item.size[1] else (32, 16) if item.size[0] > item.size[1]
             else (24, 24) for item in items]
    dataset = ImageCaptionDataset(items, RES, seed=1, target_sizes=sizes)

    loader = build_dataloader(dataset, batch_size=2, seed=3, buckets=sizes)
    batches = run_epochs(loader, 1)
    again = run_epochs(build_dataloader(dataset, batch_size=2, seed=3, buckets=sizes,
                                        num_workers=2), 1)

    assert sorted(tuple(x.shape) for _, x in batches) == [
        (1, 3, 16, 32), (1, 3, 24, 24), (1, 3, 32, 16), (2, 3, 16, 32)]
    assert len(batches) == len(loader) == len(epoch_batch_sampler(5, 2, 3, buckets=sizes))
    assert len(epoch_batch_sampler(5, 2, 3)) == 3  # without buckets: ceil(5 / 2)
    assert all(p1 == p2 and torch.equal(x1, x2) for (p1, x1), (p2, x2) in zip(batches, again))
