"""The image/caption dataset, its epoch-aware samplers, collate and DataLoader helper.

Determinism: every random choice for an item (crop, flip) comes from an RNG seeded by
(seed, epoch, index), and the shuffle order of an epoch (or, with aspect-ratio buckets, the
order within each bucket and of the batches) from a generator seeded by (seed, epoch).
Nothing depends on global RNG state or on which process loads the item, so `num_workers=0`
and `num_workers=4` give the same batches, and a resumed run can rebuild any epoch exactly.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from modules.data.captions import CaptionRules, item_caption
from modules.data.folders import ScanItem, ScanResult
from modules.data.images import load_training_image
from modules.data.masks import load_masked_sample
from modules.data.regularization import balanced_repeats
from modules.data.seeds import derive_seed

# The sampler yields (epoch, index) pairs: the dataset reads the epoch from the key itself,
# so workers (even persistent ones) never need to be told that a new epoch started.
ItemKey = tuple[int, int]


class EpochBatches(Protocol):
    """What `epoch_batch_sampler` gives: batches of (epoch, index) keys, `len()` of them per
    epoch (torch's Sampler declares no `__len__`; every batch sampler here has one)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[list[ItemKey]]: ...


def item_rng(seed: int, epoch: int, index: int) -> random.Random:
    """The RNG for one item's random crop and flip in one epoch."""
    return random.Random(derive_seed("item", seed, epoch, index))


def expand_repeats(scan: ScanResult) -> list[ScanItem]:
    """Each scanned item repeated by its source's `repeats` times its own (a kohya-style
    "N_name" subfolder's N): one epoch's worth of samples. Regularisation images are
    repeated so they balance the training samples (modules/data/regularization.py)."""
    repeats, _ = balanced_repeats(scan)
    return [item for item, count in zip(scan.items, repeats) for _ in range(count)]


def split_key(key: int | ItemKey) -> ItemKey:
    """(epoch, index) for a sampler key; a plain int index means epoch 0."""
    if isinstance(key, tuple):
        return int(key[0]), int(key[1])
    return 0, int(key)


def square_sizes(count: int, resolution: int) -> list[tuple[int, int]]:
    """`count` times (resolution, resolution): every item's target size without buckets."""
    return [(resolution, resolution)] * count


class ImageCaptionDataset(Dataset):
    """Training samples as pixels: one dict per (repeated) image.

    Items: {"pixel_values": float CHW in [-1, 1], "caption": str, "source": the item's dataset
    index, "path": str,
    "original_size": (h, w), "crop_top_left": (top, left)}. Index with an int (epoch 0) or an
    (epoch, index) pair as `EpochShuffleSampler` yields. `target_sizes` holds each item's
    (height, width), its aspect-ratio bucket; by default every item is a `resolution` square.
    With `loss_weights` (one per source) every item also carries its source's "loss_weight"
    (regularisation folders: training.prior_loss_weight); with `masked_loss` its "mask",
    float (1, H, W) in [0, 1] (modules/data/masks.py; all ones for an image without one).
    """

    def __init__(self, items: Sequence[ScanItem], resolution: int, center_crop: bool = True,
                 random_flip: bool = False, seed: int = 0,
                 target_sizes: Sequence[tuple[int, int]] | None = None,
                 caption_rules: Sequence[CaptionRules] = (),
                 loss_weights: Sequence[float] = (), masked_loss: bool = False) -> None:
        self.items = list(items)
        self.caption_rules = tuple(caption_rules)  # per source: modules/data/captions.py
        self.loss_weights = tuple(loss_weights)
        self.masked_loss = masked_loss
        self.resolution = resolution
        self.center_crop = center_crop
        self.random_flip = random_flip
        self.seed = seed
        self.target_sizes = (square_sizes(len(self.items), resolution) if target_sizes is None
                             else [(h, w) for h, w in target_sizes])
        if len(self.target_sizes) != len(self.items):
            raise ValueError(f"{len(self.target_sizes)} target sizes for {len(self.items)} items")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: int | ItemKey) -> dict[str, Any]:
        epoch, index = split_key(key)
        item = self.items[index]
        rng, masked = item_rng(self.seed, epoch, index), {}
        if self.masked_loss:
            image, masked["mask"] = load_masked_sample(
                item.path, item.mask, item.alpha, self.target_sizes[index], self.center_crop,
                self.random_flip, rng)
        else:
            image = load_training_image(item.path, self.target_sizes[index], self.center_crop,
                                        self.random_flip, rng)
        caption, varies = item_caption(item.caption, item.source_index, self.caption_rules,
                                       self.seed, epoch, index)
        return {"pixel_values": image.pixels, "caption": caption, "caption_varies": varies,
                "source": item.source_index, "path": str(item.path),
                "original_size": image.original_size,
                "crop_top_left": image.crop_top_left,
                **source_loss_weight(item, self.loss_weights), **masked}


def source_loss_weight(item: ScanItem, loss_weights: Sequence[float]) -> dict[str, float]:
    """{"loss_weight": the item's source's weight}, or {} when the run gives no weights (then
    no batch carries one and the loss is computed as without regularisation)."""
    return {"loss_weight": float(loss_weights[item.source_index])} if loss_weights else {}


class EpochCounter:
    """Seed, epoch and rank bookkeeping shared by the samplers: each `iter()` runs the current
    epoch and advances it; `set_epoch` chooses the next one (resuming a run)."""

    def __init__(self, seed: int, shuffle: bool, start_epoch: int, rank: int,
                 world_size: int) -> None:
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = start_epoch
        self.rank = rank
        self.world_size = world_size

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run `epoch`."""
        self.epoch = epoch

    def next_epoch(self) -> int:
        """The epoch this iteration runs; the following one is next."""
        epoch = self.epoch
        self.epoch += 1
        return epoch


class EpochShuffleSampler(EpochCounter, Sampler[ItemKey]):
    """Yields (epoch, index) for every index once per epoch, shuffled per (seed, epoch).

    Each `iter()` runs the current epoch and then advances it, so a training loop that simply
    iterates the DataLoader once per epoch gets a new order (and new crops/flips) each time.
    `set_epoch` chooses the next epoch explicitly (resuming a run).
    """

    def __init__(self, length: int, seed: int, shuffle: bool = True, start_epoch: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        super().__init__(seed, shuffle, start_epoch, rank, world_size)
        self.length = length

    def epoch_order(self, epoch: int) -> list[int]:
        """The order of indices in `epoch` (a pure function of seed and epoch)."""
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(derive_seed("shuffle", self.seed, epoch))
        return torch.randperm(self.length, generator=generator).tolist()

    def __len__(self) -> int:
        return -(-self.length // self.world_size)  # every rank gets the same count

    def __iter__(self) -> Iterator[ItemKey]:
        epoch = self.next_epoch()
        order = self.epoch_order(epoch)
        order = rank_share(order, self.rank, self.world_size)
        return iter([(epoch, index) for index in order])


def rank_share(order: list[int], rank: int, world_size: int) -> list[int]:
    """`rank`'s part of `order`: every rank gets ceil(len / world_size) indices.

    Pads by wrapping around (repeating from the start) so each rank gets as many items (ranks
    that ran out of batches first would otherwise wait forever for the others' gradients),
    then deals the order out round-robin.
    """
    if world_size == 1 or not order:
        return order
    per_rank = -(-len(order) // world_size)
    padded = [order[i % len(order)] for i in range(per_rank * world_size)]
    return padded[rank::world_size]


class BucketBatchSampler(EpochCounter, Sampler[list[ItemKey]]):
    """Batches of (epoch, index) keys in which every item has the same bucket.

    `buckets` holds one key per item (its target (height, width)). Each epoch, per (seed,
    epoch): the items of each bucket are shuffled, each rank takes its share of every bucket
    (`rank_share`, so all ranks get the same number of batches from each bucket), cuts it into
    batches, and the batches of all buckets are shuffled together in the same order on every
    rank, so the ranks train the same bucket at the same step. A bucket's last batch may be
    short (drop_last=False): no image is skipped, but it is one more batch shape to compile.
    """

    def __init__(self, buckets: Sequence[Hashable], batch_size: int, seed: int,
                 shuffle: bool = True, start_epoch: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.members: dict[Hashable, list[int]] = {}
        for index, bucket in enumerate(buckets):
            self.members.setdefault(bucket, []).append(index)
        self.batch_size = batch_size
        super().__init__(seed, shuffle, start_epoch, rank, world_size)

    def _share_size(self, bucket: Hashable) -> int:
        return -(-len(self.members[bucket]) // self.world_size)

    def __len__(self) -> int:
        return sum(-(-self._share_size(b) // self.batch_size) for b in self.members)

    def short_batches(self) -> int:
        """Batches per epoch (on each rank) with fewer than batch_size items."""
        return sum(1 for b in self.members if self._share_size(b) % self.batch_size)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of item indices in `epoch` (a pure function of seed and epoch)."""
        generator = torch.Generator().manual_seed(derive_seed("buckets", self.seed, epoch))
        batches: list[list[int]] = []
        for bucket in self.members:  # first-appearance order: fixed by the items
            members = self.members[bucket]
            if self.shuffle:
                members = [members[i] for i in torch.randperm(len(members),
                                                              generator=generator).tolist()]
            share = rank_share(members, self.rank, self.world_size)
            batches += [share[i:i + self.batch_size]
                        for i in range(0, len(share), self.batch_size)]
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches),
                                                          generator=generator).tolist()]
        return batches

    def __iter__(self) -> Iterator[list[ItemKey]]:
        # A generator, so the epoch advances at the first batch drawn, not at `iter()`: a
        # DataLoader with workers calls `iter()` on its batch sampler twice and keeps the second.
        epoch = self.next_epoch()
        for batch in self.epoch_batches(epoch):
            yield [(epoch, index) for index in batch]


def collate_examples(examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack a list of dataset items into a batch.

    "pixel_values" / "latents" / "mask" -> stacked tensor (B, C, H, W); "caption",
    "caption_varies", "path", "source" (each item's dataset index) -> lists;
    "original_size", "crop_top_left" -> long tensors (B, 2), ready for SDXL's time ids;
    "loss_weight" (when the items have one) -> float tensor (B,).
    """
    batch: dict[str, Any] = {}
    for name in ("pixel_values", "latents", "mask"):
        if name in examples[0]:
            batch[name] = torch.stack([example[name] for example in examples])
    batch["caption"] = [example["caption"] for example in examples]
    batch["caption_varies"] = [example.get("caption_varies", False) for example in examples]
    batch["path"] = [example["path"] for example in examples]
    batch["source"] = [example.get("source", 0) for example in examples]
    for name in ("original_size", "crop_top_left"):
        batch[name] = torch.tensor([list(example[name]) for example in examples],
                                   dtype=torch.long)
    if "loss_weight" in examples[0]:
        batch["loss_weight"] = torch.tensor([example["loss_weight"] for example in examples],
                                            dtype=torch.float32)
    return batch


def epoch_batch_sampler(length: int, batch_size: int, seed: int, shuffle: bool = True,
                        start_epoch: int = 0, rank: int = 0, world_size: int = 1,
                        buckets: Sequence[Hashable] | None = None) -> EpochBatches:
    """The batches of (epoch, index) keys a run trains on; `len()` is batches per epoch.

    Without `buckets`: `EpochShuffleSampler` cut into batches (the last one may be short).
    With `buckets` (one key per item): `BucketBatchSampler`, every batch from one bucket.
    """
    if buckets is None:
        sampler = EpochShuffleSampler(length, seed, shuffle=shuffle, start_epoch=start_epoch,
                                      rank=rank, world_size=world_size)
        # torch's stubs type BatchSampler for int indices only; it batches any sampler's items
        return BatchSampler(sampler,  # type: ignore[arg-type, return-value]  # int-only stubs
                            batch_size, drop_last=False)
    if len(buckets) != length:
        raise ValueError(f"{len(buckets)} bucket keys for {length} items")
    return BucketBatchSampler(buckets, batch_size, seed, shuffle=shuffle,
                              start_epoch=start_epoch, rank=rank, world_size=world_size)


class SkipFirstBatches(Sampler[list[ItemKey]]):
    """A batch sampler without its first `count` batches: a resumed run continues mid-epoch
    with exactly the batches it had not trained yet, without loading the ones before."""

    def __init__(self, inner: EpochBatches, count: int) -> None:
        self.inner, self.count = inner, count

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.count)

    def __iter__(self) -> Iterator[list[ItemKey]]:
        return itertools.islice(iter(self.inner), self.count, None)


def build_dataloader(dataset: Dataset, batch_size: int, seed: int, num_workers: int = 0,
                     shuffle: bool = True, start_epoch: int = 0,
                     pin_memory: bool = False, rank: int = 0, world_size: int = 1,
                     buckets: Sequence[Hashable] | None = None,
                     skip_batches: int = 0) -> DataLoader:
    """A DataLoader over `dataset` that is reproducible from the training seed.

    Batches come from `epoch_batch_sampler` (so the dataset must accept (epoch, index) keys,
    as both Tempera datasets do); the last partial batch is kept (drop_last=False), and with
    `buckets` every batch holds one bucket. The loader also gets a `torch.Generator` seeded
    from `seed`, which fixes the workers' base seed for any library code that draws from
    torch's RNG inside a worker. `skip_batches` leaves out the epoch's first batches (resume).
    """
    length = len(dataset)  # type: ignore[arg-type]  # torch's Dataset declares no __len__
    batches = epoch_batch_sampler(length, batch_size, seed,
                                  shuffle=shuffle, start_epoch=start_epoch, rank=rank,
                                  world_size=world_size, buckets=buckets)
    return epoch_dataloader(dataset, batches, seed, num_workers=num_workers,
                            pin_memory=pin_memory, skip_batches=skip_batches)


def set_sampler_epoch(batches: EpochBatches, epoch: int) -> None:
    """Make the next pass of an `epoch_batch_sampler` run `epoch`."""
    counter = batches.sampler if isinstance(batches, BatchSampler) else batches
    if not isinstance(counter, EpochCounter):
        raise TypeError(f"{type(counter).__name__} is not one of epoch_batch_sampler's samplers")
    counter.set_epoch(epoch)


def epoch_dataloader(dataset: Dataset, batches: EpochBatches, seed: int,
                     num_workers: int = 0, pin_memory: bool = False,
                     skip_batches: int = 0, persistent: bool = False) -> DataLoader:
    """A DataLoader over the next pass of `batches` (an `epoch_batch_sampler`, built once per
    run), without its first `skip_batches` (resume); see `build_dataloader`. `persistent`
    keeps its workers between passes (the batch sampler runs in the main process, so each
    pass still follows the epoch it was set to)."""
    if skip_batches:
        batches = SkipFirstBatches(batches, skip_batches)
    generator = torch.Generator().manual_seed(derive_seed("loader", seed))
    return DataLoader(dataset, batch_sampler=batches, num_workers=num_workers,
                      collate_fn=collate_examples, generator=generator,
                      pin_memory=pin_memory,
                      persistent_workers=persistent and num_workers > 0)
