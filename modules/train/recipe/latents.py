"""Latent caching for a run: encode every image once with the run's VAE, then train on latents."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from modules.data.dataset import ImageCaptionDataset
from modules.data.progress import RateMeter
from modules.data.latent_cache import CachedLatentDataset, LatentCache, cache_latents, vae_fingerprint
from modules.events import TrainerCallbacks
from modules.models.families import family_of
from modules.train.setup.prepare import PreparedRun


def cached_latent_dataset(dataset: ImageCaptionDataset, prepared: PreparedRun,
                          callbacks: TrainerCallbacks,
                          should_stop: Callable[[], bool] = lambda: False
                          ) -> CachedLatentDataset:
    """Fill the on-disk latent cache for the dataset's images and return a latent dataset.
    Stop (`should_stop`) is honoured between batches: StopRequested.

    Cached latents are the VAE posterior's mean × scaling factor (deterministic, so the cache
    is reusable across runs); the pixel path samples the posterior instead.
    """
    vae, device = prepared.bundle.vae, prepared.device
    upcast = encodes_upcast(vae.dtype, device)
    # the entries of a float32 encode are another encode_fn's: keyed apart (vae_fingerprint)
    fingerprint = vae_fingerprint(vae) + ("|float32-encode" if upcast else "")
    cache = LatentCache(prepared.cache_dir / "latents", fingerprint)
    normalise = family_of(prepared.bundle.model_type).vae_latents

    @torch.no_grad()
    def encode(pixels: torch.Tensor) -> torch.Tensor:
        posterior = vae.encode(pixels.to(device, vae.dtype)).latent_dist
        return normalise(vae, posterior.mean).float().cpu()

    with at_float32(vae) if upcast else contextlib.nullcontext():
        stats = cache_latents(dataset.items, encode, cache, dataset.resolution,
                              center_crop=dataset.center_crop, random_flip=dataset.random_flip,
                              seed=dataset.seed,
                              progress_callback=RateMeter("caching latents",
                                                          callbacks.on_status, unit="latents"),
                              target_sizes=dataset.target_sizes, should_stop=should_stop,
                              masked_loss=dataset.masked_loss)
    callbacks.on_status(f"latent cache: {stats.hits} reused, {stats.misses} encoded")
    return CachedLatentDataset(dataset.items, stats.entries, cache,
                               random_flip=dataset.random_flip, seed=dataset.seed,
                               target_sizes=dataset.target_sizes,
                               caption_rules=dataset.caption_rules,
                               loss_weights=dataset.loss_weights,
                               masked_loss=dataset.masked_loss)


def encodes_upcast(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the caching pass encodes at float32 instead of the VAE's 16-bit dtype: on the
    CPU only, where 16-bit convolutions without native bfloat16 units (most desktop CPUs) run
    about 15 times slower than float32 ones (the tiny VAE at 256 px: 8.2 s against 0.5 s a
    batch). Every 16-bit weight is exact in float32, so the weights come back unchanged; the
    latents are float32's, as precise as any. On a GPU the VAE encodes at its own dtype."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def at_float32(module: torch.nn.Module) -> Iterator[None]:
    """`module`'s floating-point weights and buffers at float32 for the block, each back at
    its own dtype afterwards (also when the block raises): exact both ways from 16 bits."""
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    own = [t.dtype for t in tensors]
    for tensor in tensors:
        tensor.data = tensor.data.float()
    try:
        yield
    finally:
        for tensor, dtype in zip(tensors, own):
            tensor.data = tensor.data.to(dtype)
