"""The image/caption dataset, its epoch-aware shuffling sampler, collate and DataLoader helper.

Determinism: every random choice for an item (crop, flip) comes from an RNG seeded by
(seed, epoch, index), and the shuffle order of an epoch from a generator seeded by
(seed, epoch). Nothing depends on global RNG state or on which process loads the item, so
`num_workers=0` and `num_workers=4` give the same batches, and a resumed run can rebuild any
epoch exactly.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from modules.data.folders import ScanItem, ScanResult
from modules.data.images import load_training_image

# The sampler yields (epoch, index) pairs: the dataset reads the epoch from the key itself,
# so workers (even persistent ones) never need to be told that a new epoch started.
ItemKey = tuple[int, int]


def derive_seed(*parts: object) -> int:
    """A 64-bit seed from `parts` (stable across processes, unlike `hash()` on str)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


def item_rng(seed: int, epoch: int, index: int) -> random.Random:
    """The RNG for one item's random crop and flip in one epoch."""
    return random.Random(derive_seed("item", seed, epoch, index))


def expand_repeats(scan: ScanResult) -> list[ScanItem]:
    """Each scanned item repeated by its source's `repeats` (one epoch's worth of samples)."""
    return [item for item in scan.items for _ in range(scan.sources[item.source_index].repeats)]


def split_key(key: int | ItemKey) -> ItemKey:
    """(epoch, index) for a sampler key; a plain int index means epoch 0."""
    if isinstance(key, tuple):
        return int(key[0]), int(key[1])
    return 0, int(key)


class ImageCaptionDataset(Dataset):
    """Training samples as pixels: one dict per (repeated) image.

    Items: {"pixel_values": float CHW in [-1, 1], "caption": str, "path": str,
    "original_size": (h, w), "crop_top_left": (top, left)}. Index with an int (epoch 0) or an
    (epoch, index) pair as `EpochShuffleSampler` yields.
    """

    def __init__(self, items: Sequence[ScanItem], resolution: int, center_crop: bool = True,
                 random_flip: bool = False, seed: int = 0) -> None:
        self.items = list(items)
        self.resolution = resolution
        self.center_crop = center_crop
        self.random_flip = random_flip
        self.seed = seed

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: int | ItemKey) -> dict[str, Any]:
        epoch, index = split_key(key)
        item = self.items[index]
        image = load_training_image(item.path, self.resolution, self.center_crop,
                                    self.random_flip, item_rng(self.seed, epoch, index))
        return {"pixel_values": image.pixels, "caption": item.caption, "path": str(item.path),
                "original_size": image.original_size, "crop_top_left": image.crop_top_left}


class EpochShuffleSampler(Sampler[ItemKey]):
    """Yields (epoch, index) for every index once per epoch, shuffled per (seed, epoch).

    Each `iter()` runs the current epoch and then advances it, so a training loop that simply
    iterates the DataLoader once per epoch gets a new order (and new crops/flips) each time.
    `set_epoch` chooses the next epoch explicitly (resuming a run).
    """

    def __init__(self, length: int, seed: int, shuffle: bool = True, start_epoch: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        self.length = length
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = start_epoch
        self.rank = rank
        self.world_size = world_size

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run `epoch`."""
        self.epoch = epoch

    def epoch_order(self, epoch: int) -> list[int]:
        """The order of indices in `epoch` (a pure function of seed and epoch)."""
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(derive_seed("shuffle", self.seed, epoch))
        return torch.randperm(self.length, generator=generator).tolist()

    def __len__(self) -> int:
        return -(-self.length // self.world_size)  # every rank gets the same count

    def __iter__(self) -> Iterator[ItemKey]:
        epoch = self.epoch
        self.epoch += 1
        order = self.epoch_order(epoch)
        if self.world_size > 1:
            # Pad by wrapping around so each rank gets as many items (ranks that ran out of
            # batches first would otherwise wait forever for the others' gradients), then deal
            # the shuffled order out round-robin.
            order += order[:len(self) * self.world_size - len(order)]
            order = order[self.rank::self.world_size]
        return iter([(epoch, index) for index in order])


def collate_examples(examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack a list of dataset items into a batch.

    "pixel_values" / "latents" -> stacked tensor (B, C, H, W); "caption", "path" -> lists;
    "original_size", "crop_top_left" -> long tensors (B, 2), ready for SDXL's time ids.
    """
    batch: dict[str, Any] = {}
    for name in ("pixel_values", "latents"):
        if name in examples[0]:
            batch[name] = torch.stack([example[name] for example in examples])
    batch["caption"] = [example["caption"] for example in examples]
    batch["path"] = [example["path"] for example in examples]
    for name in ("original_size", "crop_top_left"):
        batch[name] = torch.tensor([list(example[name]) for example in examples],
                                   dtype=torch.long)
    return batch


def build_dataloader(dataset: Dataset, batch_size: int, seed: int, num_workers: int = 0,
                     shuffle: bool = True, start_epoch: int = 0,
                     pin_memory: bool = False, rank: int = 0, world_size: int = 1) -> DataLoader:
    """A DataLoader over `dataset` that is reproducible from the training seed.

    Uses `EpochShuffleSampler` (so the dataset must accept (epoch, index) keys, as both
    Tempera datasets do) and keeps the last partial batch (drop_last=False). The loader also
    gets a `torch.Generator` seeded from `seed`, which fixes the workers' base seed for any
    library code that draws from torch's RNG inside a worker.
    """
    sampler = EpochShuffleSampler(len(dataset), seed, shuffle=shuffle,  # type: ignore[arg-type]
                                  start_epoch=start_epoch, rank=rank, world_size=world_size)
    generator = torch.Generator().manual_seed(derive_seed("loader", seed))
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      collate_fn=collate_examples, drop_last=False, generator=generator,
                      pin_memory=pin_memory, persistent_workers=False)
