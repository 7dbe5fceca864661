"""The text encoder first, alone (issue 56 item 2): a run that caches every caption up front
loads the tokenizer and the text encoder, encodes and caches every caption and every sample,
validation and negative prompt it will read, releases the encoder (no reference left, then
collected), and only then loads the VAE and the denoiser. The two are never in system RAM
together: a 9B Klein run peaks at the larger of the two phases instead of their sum (the RAM
plan, train/memory/ram_plan.py, plans it so).

`text_encoder_first` (train/recipe/text_cache.py) says when it applies; otherwise the whole
model loads at once, as before. The cache this builds is the run's (`PreparedRun.text_cache`):
setup finds every caption in it and the samples take the cached prompts, so the run never
needs the encoder again.
"""
from __future__ import annotations

import dataclasses
import gc
from typing import TYPE_CHECKING

import torch

from modules.events import TrainerCallbacks
from modules.models.bundle import ModelBundle
from modules.models.loader import load_text_part, load_without_text_encoders
from modules.train.recipe.builders import pick_device
from modules.train.recipe.text_cache import TextEncoderCache
from modules.train.recipe.text_store import TextEmbeddingStore, encoder_identity
from modules.train.recipe.trainable import component_dtypes

if TYPE_CHECKING:
    from modules.train.setup.prepare import CheckedRun


def encode_text_first(checked: CheckedRun, callbacks: TrainerCallbacks) -> TextEncoderCache:
    """Load the text encoder alone, cache every caption the run will read (on disk, keyed by
    the encoder as `text_encoder_cache` keys it), release the encoder and return the cache,
    its bundle holding the tokenizers only (`load_model_after_text` puts the model in)."""
    from modules.train.setup.start import known_captions
    config = checked.config
    device = pick_device(config.general.device)
    callbacks.on_status("loading the text encoder alone: every caption is cached before the "
                        "model loads, and the encoder is released first")
    encoders, tokenizers = load_text_part(checked.model_path, config.model,
                                          component_dtypes(config))
    text_only = ModelBundle(config.model.type, checked.model_path, None, None, encoders,
                            tokenizers, None)
    store = TextEmbeddingStore(checked.cache_dir / "text-embeddings", encoder_identity(text_only))
    cache = TextEncoderCache(text_only, device, store)
    for module in encoders.values():
        module.to(device)
    captions = known_captions(checked)
    encoded = cache.precache(captions)
    release_text_encoders(cache, device)
    del encoders, text_only
    gc.collect()  # a reference cycle inside the model would otherwise keep it until later
    callbacks.on_status(f"text encoder outputs: {len(captions)} captions cached on disk "
                        f"({encoded} encoded now, {len(captions) - encoded} read from "
                        f"{store.folder}); the text encoder is released before the model "
                        "loads")
    return cache


def release_text_encoders(cache: TextEncoderCache, device: torch.device) -> None:
    """Drop the cache's references to the text encoders (its bundle keeps the tokenizers), and
    the device memory they held."""
    cache.bundle.text_encoders.clear()
    cache.bundle = dataclasses.replace(cache.bundle, text_encoders={})
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_model_after_text(checked: CheckedRun, cache: TextEncoderCache) -> ModelBundle:
    """The model without its text encoders, the tokenizers the cache holds handed on; the
    cache then belongs to this bundle (its `encoders_left`: the samples take cached prompts)."""
    config = checked.config
    bundle = load_without_text_encoders(checked.model_path, config.model,
                                        component_dtypes(config), cache.bundle.tokenizers)
    cache.bundle = bundle
    return bundle
