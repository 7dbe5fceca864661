"""The on-disk latent cache: encode every training image with the VAE once, reuse it across runs.

One `.safetensors` file per (image content, target size, crop, flip, VAE). The key hashes the
image *bytes*, not its path or mtime, so editing an image, changing the resolution, its
aspect-ratio bucket or the crop mode, or swapping the VAE never serves a stale latent. An image
trained at several resolutions (data.resolutions) has one entry per target size, each under
its own key; the key format is the one single-resolution runs wrote, so their entries stay
valid. A file
that cannot be read is treated as a miss (re-encoded and overwritten, with a warning), never a
crash.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset

from modules.data.dataset import ItemKey, item_rng, source_loss_weight, split_key, square_sizes
from modules.data.captions import CaptionRules, item_caption
from modules.data.seeds import derive_seed
from modules.data.errors import DatasetError
from modules.data.folders import ScanItem
from modules.data.images import (TargetSize, coin_flip, open_rgb, plan_crop,
                                 prepare_image, target_hw)
from modules.data.masks import latent_mask, open_mask, prepare_mask
from modules.data.progress import ProgressCallback
from modules.events import StopRequested
from modules.util.atomic import atomic_file

logger = logging.getLogger("tempera.data")

# Bump when what a cache file holds, or how keys are built, changes. 2: the key holds the
# target (height, width) instead of a square resolution (aspect-ratio buckets).
CACHE_FORMAT_VERSION = 2
_HASH_CHUNK = 1 << 20
# Bytes hashed from the start of each VAE tensor once the whole state dict is too big to hash.
_SAMPLED_BYTES_PER_TENSOR = 16 * 1024

EncodeFn = Callable[[torch.Tensor], torch.Tensor]


class ContentHasher:
    """sha256 of a file's bytes, remembered per (path, size, mtime_ns) for this process.

    Re-reading every image to hash it is the slow part of a warm cache check; the memo makes a
    second check in the same run free, while any edit (new size or mtime) forces a re-hash.
    """

    def __init__(self) -> None:
        self._memo: dict[tuple[str, int, int], str] = {}

    def sha256(self, path: Path) -> str:
        """Hex sha256 of `path`'s bytes; DatasetError naming the file if it cannot be read."""
        try:
            stat = os.stat(path)
            memo_key = (str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)
            digest = self._memo.get(memo_key)
            if digest is None:
                digest = file_sha256(path)
                self._memo[memo_key] = digest
        except OSError as exc:
            raise DatasetError(f"cannot read image {path}: {exc}") from exc
        return digest


def file_sha256(path: Path) -> str:
    """Hex sha256 of the file's bytes."""
    hasher = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(_HASH_CHUNK), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def vae_fingerprint(vae: Any, full_hash_limit_bytes: int = 64 * 2**20) -> str:
    """A string that changes when the VAE (config or weights, incl. dtype) changes.

    Hashes the config (minus private keys such as `_name_or_path`, so the same weights loaded
    from another folder keep their cache) and every tensor's name, shape and dtype. Weight
    bytes: all of them when the state dict is at most `full_hash_limit_bytes` (tiny VAEs);
    otherwise the first 16 KiB of every tensor (the SD VAE is ~335 MB in fp32).
    Trade-off of the sampled mode: any real fine-tune or re-save in another dtype changes those
    bytes, but an edit confined to the tail of a tensor would go unnoticed; delete the cache
    folder after such surgery. A trainer whose `encode_fn` changes behaviour (e.g. latent mean
    vs sample) should append a tag to this string.
    """
    raw = getattr(vae, "config", {})  # diffusers' dict, or a transformers config object
    raw = raw.to_dict() if hasattr(raw, "to_dict") else dict(raw)
    config = {k: v for k, v in raw.items() if not k.startswith("_")}
    hasher = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode("utf-8"))
    state = vae.state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    limit = None if total <= full_hash_limit_bytes else _SAMPLED_BYTES_PER_TENSOR
    for name in sorted(state):
        tensor = state[name]
        hasher.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode("utf-8"))
        hasher.update(_tensor_bytes(tensor, limit))
    mode = "full" if limit is None else "sampled"
    return f"{mode}-{hasher.hexdigest()}"


def _tensor_bytes(tensor: torch.Tensor, limit: int | None) -> bytes:
    """Raw bytes of `tensor` (the first `limit` of them when given), copied to the CPU. A
    tensor subclass (a float8-stored text encoder weight: torchao's Float8Tensor, which cannot
    be flattened) is read as the plain tensors it is made of (its values and scales)."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None and type(tensor) is not torch.nn.Parameter:
        return b"".join(_tensor_bytes(getattr(tensor, name), limit) for name in flatten()[0])
    flat = tensor.detach().reshape(-1)
    if limit is not None:
        flat = flat[: max(1, limit // max(1, tensor.element_size()))]
    return flat.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def latent_key(content_sha256: str, target: TargetSize, center_crop: bool,
               crop_top_left: tuple[int, int], flipped: bool, vae_fingerprint: str,
               mask: str | None = None) -> str:
    """The cache key of one latent: everything that changes what the VAE would produce.

    `target` is the square resolution or the image's bucket (height, width). The crop position
    is part of the key too: with a center crop it follows from the content and target, with a
    random crop it is the one crop cached for the image. `mask` names the loss mask stored
    with the latent (data.masked_loss: "file:<its sha256>" or "alpha"); an entry without one
    keeps the key it had before masks existed, and one with a mask is never served to a run
    that asks without, nor the other way round.
    """
    fields = {"version": CACHE_FORMAT_VERSION, "content": content_sha256,
              "target_size": list(target_hw(target)), "center_crop": center_crop,
              "crop_top_left": list(crop_top_left), "flipped": flipped, "vae": vae_fingerprint}
    if mask is not None:
        fields["mask"] = mask
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class LatentEntry:
    """A cached latent (as `encode_fn` returned it, on the CPU), its SDXL size conditioning
    and its loss mask at the latent's size (1, h, w), when it was cached with one."""
    latent: torch.Tensor
    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    mask: torch.Tensor | None = None


class LatentCache:
    """A folder of `<key>.safetensors` latents for one VAE.

    Writes are atomic (temporary file in the same folder, then `os.replace`), so an
    interrupted run never leaves a half-written entry behind. `corrupt` counts unreadable
    entries met so far (each was reported with a warning and served as a miss).
    """

    def __init__(self, cache_dir: Path, vae_fingerprint: str,
                 hasher: ContentHasher | None = None) -> None:
        self.cache_dir = Path(cache_dir)
        self.vae_fingerprint = vae_fingerprint
        self.hasher = hasher or ContentHasher()
        self.corrupt = 0

    def key_for(self, path: Path, target: TargetSize, center_crop: bool,
                crop_top_left: tuple[int, int], flipped: bool, mask: str | None = None) -> str:
        """The key of image `path` (by content) under this cache's VAE, with its mask's name."""
        return latent_key(self.hasher.sha256(path), target, center_crop, crop_top_left,
                          flipped, self.vae_fingerprint, mask)

    def path_for(self, key: str) -> Path:
        return self.cache_dir / f"{key}.safetensors"

    def get(self, key: str) -> torch.Tensor | None:
        """The cached latent for `key`, or None on a miss (absent or unreadable file)."""
        entry = self.get_entry(key)
        return None if entry is None else entry.latent

    def get_entry(self, key: str, require_mask: bool = False) -> LatentEntry | None:
        """The cached latent and its metadata, or None on a miss (absent or unreadable, or
        without the mask `require_mask` asks for)."""
        path = self.path_for(key)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as file:
                metadata = file.metadata() or {}
                latent = file.get_tensor("latent")
                mask = file.get_tensor("mask") if "mask" in file.keys() else None
            if metadata.get("vae_fingerprint") != self.vae_fingerprint:
                raise ValueError("written for another VAE")
            if require_mask and mask is None:
                raise ValueError("it holds no loss mask")
            entry = LatentEntry(latent, _parse_pair(metadata["original_size"]),
                                _parse_pair(metadata["crop_top_left"]), mask)
        # safetensors raises its own error type, OSError, KeyError or ValueError for a damaged
        # file; all of them mean "re-encode this entry", reported below.
        except Exception as exc:  # noqa: BLE001 - reported and counted, served as a miss
            self.corrupt += 1
            logger.warning("latent cache file %s is unreadable (%s: %s); it will be re-encoded",
                           path, type(exc).__name__, exc)
            return None
        return entry

    def put(self, key: str, latent: torch.Tensor, original_size: tuple[int, int] = (0, 0),
            crop_top_left: tuple[int, int] = (0, 0), mask: torch.Tensor | None = None) -> Path:
        """Store `latent` (and its loss `mask`) under `key` atomically (overwrites a previous
        or corrupt entry)."""
        path = self.path_for(key)
        metadata = {"format": str(CACHE_FORMAT_VERSION), "vae_fingerprint": self.vae_fingerprint,
                    "original_size": _format_pair(original_size),
                    "crop_top_left": _format_pair(crop_top_left)}
        tensors = {"latent": latent.detach().to("cpu").contiguous().clone()}
        if mask is not None:
            tensors["mask"] = mask.detach().to("cpu", torch.float32).contiguous().clone()
        with atomic_file(path) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)
        return path


def _format_pair(pair: tuple[int, int]) -> str:
    return f"{int(pair[0])},{int(pair[1])}"


def _parse_pair(text: str) -> tuple[int, int]:
    first, second = text.split(",")
    return int(first), int(second)


@dataclass(frozen=True)
class CachedImage:
    """The cache keys of one image: `keys[flipped]` (both orientations when flips are on);
    `masked` when its entries hold a loss mask."""
    path: Path
    keys: Mapping[bool, str]
    masked: bool = False


# An entry of `CacheStats.entries`: an image and the (height, width) it is cached at.
EntryKey = tuple[Path, tuple[int, int]]


@dataclass
class CacheStats:
    """What `cache_latents` did: entries found, encoded, found corrupt, and the keys of every
    (image, target size) (an image trained at several resolutions has one per size)."""
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    entries: dict[EntryKey, CachedImage] = field(default_factory=dict)


@dataclass(frozen=True)
class _Pending:
    path: Path
    key: str
    target: tuple[int, int]
    crop_top_left: tuple[int, int]
    flipped: bool
    item: ScanItem | None = None  # the item whose loss mask is stored with the latent


def mask_name(item: ScanItem, hasher: ContentHasher) -> str | None:
    """The name of an item's loss mask in cache keys: its mask file by content, its alpha
    channel (already in the image's content hash), or None (no mask: an unmasked entry)."""
    if item.mask is not None:
        return "file:" + hasher.sha256(item.mask)
    return "alpha" if item.alpha else None


def cache_latents(items: Sequence[ScanItem], encode_fn: EncodeFn, cache: LatentCache,
                  resolution: int, center_crop: bool = True, random_flip: bool = False,
                  seed: int = 0, batch_size: int = 4,
                  progress_callback: ProgressCallback | None = None,
                  target_sizes: Sequence[tuple[int, int]] | None = None,
                  should_stop: Callable[[], bool] = lambda: False,
                  masked_loss: bool = False) -> CacheStats:
    """Make sure every image in `items` has its latent(s) in `cache`; encode the missing ones.

    `encode_fn` maps a CPU float32 pixel batch (B, 3, H, W) in [-1, 1] to latents (B, ...):
    the trainer moves it to its device/dtype and applies the VAE scaling factor. It runs under
    `torch.no_grad()`. Each image is cropped to its entry in `target_sizes` (its aspect-ratio
    bucket; default a `resolution` square) and an encoded batch holds one size only.
    Repeated items are encoded once. With `random_flip` both orientations are cached. With a
    random crop, each image gets one crop drawn from (seed, content), so the cache stays valid
    across runs; a warning says new crops per epoch need caching off.
    `progress_callback(done, total)` counts latents resolved (hit or encoded).
    `should_stop` is asked before each image is looked up and each batch is encoded; when it
    says so, StopRequested is raised (every latent stored so far is whole and stays cached).
    With `masked_loss` an image's loss mask (modules/data/masks.py), averaged down to the
    latent's size, is stored in the same file, under a key that names the mask.
    """
    if not center_crop:
        logger.warning("random crop with cached latents: each image keeps one random crop drawn "
                       "once from the seed; turn latent caching off for a new crop every epoch")
    stats = CacheStats()
    corrupt_before = cache.corrupt
    targets = _distinct_targets(items, resolution, target_sizes)
    item_of = {Path(item.path): item for item in items}
    flips = (False, True) if random_flip else (False,)
    total, pending = len(targets) * len(flips), []
    for path, target in targets:
        if should_stop():
            raise StopRequested(f"latent caching stopped after {stats.hits} of {total} "
                                "latents were checked")
        content = cache.hasher.sha256(path)
        crop_rng = None if center_crop else random.Random(derive_seed("crop", seed, content))
        crop = plan_crop(item_of[path].oriented_size(), target, center_crop, crop_rng)
        mask = mask_name(item_of[path], cache.hasher) if masked_loss else None
        keys = {flip: cache.key_for(path, target, center_crop, crop, flip, mask)
                for flip in flips}
        stats.entries[(path, target)] = CachedImage(path, keys, masked=mask is not None)
        for flip, key in keys.items():
            if cache.get_entry(key, require_mask=mask is not None) is not None:
                stats.hits += 1
                _report(progress_callback, stats.hits, total)
            else:
                pending.append(_Pending(path, key, target, crop, flip,
                                        item_of[path] if mask is not None else None))
    for batch in _same_size_batches(pending, batch_size):
        if should_stop():
            raise StopRequested(f"latent caching stopped with {stats.hits + stats.misses} of "
                                f"{total} latents cached")
        _encode_batch(batch, encode_fn, cache)
        stats.misses += len(batch)
        _report(progress_callback, stats.hits + stats.misses, total)
    stats.corrupt = cache.corrupt - corrupt_before
    logger.info("latent cache %s: %d hits, %d encoded (%d corrupt entries replaced)",
                cache.cache_dir, stats.hits, stats.misses, stats.corrupt)
    return stats


def _distinct_targets(items: Sequence[ScanItem], resolution: int,
                      target_sizes: Sequence[tuple[int, int]] | None) -> list[EntryKey]:
    """Each distinct (image, target size), in first-appearance order (repeats share one; an
    image at several resolutions has one per size)."""
    if target_sizes is None:
        target_sizes = square_sizes(len(items), resolution)
    if len(target_sizes) != len(items):
        raise ValueError(f"{len(target_sizes)} target sizes for {len(items)} items")
    pairs = ((Path(item.path), target_hw(target)) for item, target in zip(items, target_sizes))
    return list(dict.fromkeys(pairs))


def _same_size_batches(pending: Sequence[_Pending], batch_size: int) -> list[list[_Pending]]:
    """`pending` cut into batches of at most `batch_size` that share one target size."""
    by_size: dict[tuple[int, int], list[_Pending]] = {}
    for entry in pending:
        by_size.setdefault(entry.target, []).append(entry)
    return [group[i:i + batch_size] for group in by_size.values()
            for i in range(0, len(group), batch_size)]


def _encode_batch(batch: Sequence[_Pending], encode_fn: EncodeFn, cache: LatentCache) -> None:
    """Load, encode and store one batch of missing latents (all of one target size)."""
    prepared = [prepare_image(open_rgb(p.path), p.target, p.crop_top_left, p.flipped)
                for p in batch]
    with torch.no_grad():
        latents = encode_fn(torch.stack([image.pixels for image in prepared]))
    if latents.shape[0] != len(batch):
        raise ValueError(f"encode_fn returned {latents.shape[0]} latents for {len(batch)} images")
    for pending, image, latent in zip(batch, prepared, latents):
        cache.put(pending.key, latent, image.original_size, image.crop_top_left,
                  _latent_mask(pending, latent.shape[-2:]))


def _latent_mask(pending: _Pending, size) -> torch.Tensor | None:
    """The pending image's loss mask through its crop and flip, averaged to `size`."""
    if pending.item is None:
        return None
    image = open_mask(pending.item.mask, pending.path, pending.item.alpha)
    mask = prepare_mask(image, pending.target, pending.crop_top_left, pending.flipped)
    return latent_mask(mask.unsqueeze(0), size)[0]


def _report(callback: ProgressCallback | None, done: int, total: int) -> None:
    if callback is not None:
        callback(done, total)


class CachedLatentDataset(Dataset):
    """Training samples as cached latents; the same items and keys as `ImageCaptionDataset`.

    Items: {"latents": tensor, "caption", "path", "original_size", "crop_top_left"}. The flip
    of each item is drawn per (seed, epoch, index) like the pixel dataset's. Build it from the
    `CacheStats.entries` of a `cache_latents` call over the same items; `target_sizes` (the
    items' buckets or squares, as given to `cache_latents`) picks each item's entry and is
    kept for the bucket batch sampler. Without it every image must have one cached size.
    """

    def __init__(self, items: Sequence[ScanItem], entries: Mapping[EntryKey, CachedImage],
                 cache: LatentCache, random_flip: bool = False, seed: int = 0,
                 target_sizes: Sequence[tuple[int, int]] | None = None,
                 caption_rules: Sequence[CaptionRules] = (),
                 loss_weights: Sequence[float] = (), masked_loss: bool = False) -> None:
        self.items = list(items)
        self.target_sizes = None if target_sizes is None else [(h, w) for h, w in target_sizes]
        self.entry_keys = _entry_keys(self.items, entries, self.target_sizes)
        self.entries = entries
        self.cache = cache
        self.random_flip = random_flip
        self.seed = seed
        self.caption_rules = tuple(caption_rules)
        self.loss_weights = tuple(loss_weights)
        self.masked_loss = masked_loss

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: int | ItemKey) -> dict[str, Any]:
        epoch, index = split_key(key)
        item = self.items[index]
        flip = self.random_flip and coin_flip(item_rng(self.seed, epoch, index))
        cached = self.entries[self.entry_keys[index]]
        cache_key = cached.keys[flip]
        entry = self.cache.get_entry(cache_key, require_mask=cached.masked)
        if entry is None:
            raise DatasetError(f"the cached latent of {item.path} disappeared or was damaged "
                               f"during the run ({self.cache.path_for(cache_key)}); restart "
                               "to re-encode it")
        caption, varies = item_caption(item.caption, item.source_index, self.caption_rules,
                                       self.seed, epoch, index)
        return {"latents": entry.latent, "caption": caption, "caption_varies": varies,
                "source": item.source_index, "path": str(item.path),
                "original_size": entry.original_size,
                "crop_top_left": entry.crop_top_left,
                **source_loss_weight(item, self.loss_weights), **self._mask(entry)}

    def _mask(self, entry: LatentEntry) -> dict[str, torch.Tensor]:
        """{"mask": the entry's loss mask, all ones for an image without one} under
        masked_loss, else {}."""
        if not self.masked_loss:
            return {}
        if entry.mask is not None:
            return {"mask": entry.mask}
        return {"mask": torch.ones(1, *entry.latent.shape[-2:])}


def _entry_keys(items: Sequence[ScanItem], entries: Mapping[EntryKey, CachedImage],
                target_sizes: Sequence[tuple[int, int]] | None) -> list[EntryKey]:
    """The `entries` key of each item: its image at its target size (the image's only cached
    size when `target_sizes` is None). ValueError when an item was not cached, or is ambiguous."""
    sizes_of: dict[Path, list[tuple[int, int]]] = {}
    for path, size in entries:
        sizes_of.setdefault(path, []).append(size)
    keys = []
    for index, item in enumerate(items):
        path = Path(item.path)
        if target_sizes is not None:
            key = (path, target_sizes[index])
        elif len(sizes_of.get(path, [])) > 1:
            raise ValueError(f"{path} is cached at {len(sizes_of[path])} sizes; give each "
                             "item's target size (target_sizes)")
        else:
            key = (path, sizes_of[path][0]) if path in sizes_of else (path, (0, 0))
        if key not in entries:
            raise ValueError(f"item {index} ({path}) was not cached at {key[1]}; run "
                             "cache_latents over the same items and target sizes first")
        keys.append(key)
    return keys
