"""Latent caching for a run: encode every image once with the run's VAE, then train on latents."""
from __future__ import annotations

from collections.abc import Callable

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
    cache = LatentCache(prepared.cache_dir / "latents", vae_fingerprint(vae))
    normalise = family_of(prepared.bundle.model_type).vae_latents

    @torch.no_grad()
    def encode(pixels: torch.Tensor) -> torch.Tensor:
        posterior = vae.encode(pixels.to(device, vae.dtype)).latent_dist
        return normalise(vae, posterior.mean).float().cpu()

    stats = cache_latents(dataset.items, encode, cache, dataset.resolution,
                          center_crop=dataset.center_crop, random_flip=dataset.random_flip,
                          seed=dataset.seed,
                          progress_callback=RateMeter("caching latents", callbacks.on_status,
                                                      unit="latents"),
                          target_sizes=dataset.target_sizes, should_stop=should_stop,
                          masked_loss=dataset.masked_loss)
    callbacks.on_status(f"latent cache: {stats.hits} reused, {stats.misses} encoded")
    return CachedLatentDataset(dataset.items, stats.entries, cache,
                               random_flip=dataset.random_flip, seed=dataset.seed,
                               target_sizes=dataset.target_sizes,
                               caption_rules=dataset.caption_rules,
                               loss_weights=dataset.loss_weights,
                               masked_loss=dataset.masked_loss)
