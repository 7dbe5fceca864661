"""The text encoder first, alone (issue 56 item 2): a run that caches every caption up front
loads the tokenizer and the text encoder, encodes and caches every caption and every sample,
validation and negative prompt it will read, releases the encoder (no reference left, then
collected), and only then loads the VAE and the denoiser. The two are never in system RAM
together: a 9B Klein run peaks at the larger of the two phases instead of their sum (the RAM
plan, train/memory/ram_plan.py, plans it so).

`text_encoder_first` (train/recipe/text_cache.py) says when it applies; otherwise the whole
model loads at once, as before. The cache this builds is the run's (`PreparedRun.text_cache`):
setup finds every caption in it and the samples take the cached prompts, so the run never
needs the encoder again. ComfyUI's split files take the same order (a family whose
`TextFirst` has a `split_config_folder`): the text encoder from model.text_encoder_path alone,
then the diffusion model and VAE files. A run whose captions were all cached by an earlier one
(a resumed run) does not load the encoder at all: the encoder's files, read without loading
them, name the cache folder the encoder they hold had (`text_store.encoder_files_key`).
"""
from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Protocol

import torch

from modules.config.schema import Config
from modules.events import TrainerCallbacks
from modules.model_types import MODEL_TYPES
from modules.models.bundle import ModelBundle, dtype_of
from modules.models.loader import load_text_part, load_tokenizers, load_without_text_encoders
from modules.train.recipe.builders import pick_device
from modules.train.recipe.text_cache import TextEncoderCache
from modules.train.setup.run_captions import ScannedRun, known_captions
from modules.train.recipe.text_store import (TextEmbeddingStore, encoder_files_key,
                                             encoder_identity, known_identity,
                                             remember_identity)
from modules.models.weight_storage import store_weights
from modules.train.recipe.trainable import component_dtypes, stored_components


class CheckedRun(ScannedRun, Protocol):
    """What this step reads of prepare.py's CheckedRun (prepare sits above this file and calls
    it): the run's inputs, its model's path and its cache folder."""
    model_path: Path
    cache_dir: Path


def encode_text_first(checked: CheckedRun, callbacks: TrainerCallbacks) -> TextEncoderCache:
    """Cache every caption the run will read (on disk, keyed by the encoder as
    `text_encoder_cache` keys it) and return the cache, its bundle holding the tokenizers only
    (`load_model_after_text` puts the model in). When the encoder's files were seen before
    (`known_identity`) and every caption is cached already (a resumed run, a second run on the
    same data), the encoder is not loaded at all; otherwise it is loaded alone, encodes what is
    missing and is released."""
    config = checked.config
    root = checked.cache_dir / "text-embeddings"
    files = encoder_files(checked)
    captions = known_captions(checked)
    identity = known_identity(root, files)
    if identity is not None:
        tokenizers = load_tokenizers(checked.model_path, config.model)
        cache = TextEncoderCache(text_only_bundle(checked, {}, tokenizers),
                                 pick_device(config.general.device),
                                 TextEmbeddingStore(root, identity))
        if not cache.missing(captions):
            callbacks.on_status(f"text encoder outputs: all {len(captions)} captions read from "
                                f"{root / identity}; the text encoder is not loaded")
            return cache
    cache, identity = encode_with_encoder_alone(checked, captions, callbacks)
    remember_identity(root, files, identity)
    return cache


def encoder_files(checked: CheckedRun) -> str:
    """`encoder_files_key` of the run's text encoders and tokenizers, as they will load."""
    config = checked.config
    spec = MODEL_TYPES[config.model.type]
    dtypes = component_dtypes(config)
    stored = stored_components(config)
    load = {"model_type": config.model.type.value,
            **{name: str(dtype_of(dtypes, name)) for name in spec.text_encoders},
            **{f"{name} storage": config.model.weight_storage.value
               for name in spec.text_encoders if name in stored}}
    folder = split_config_folder(config)
    if folder is None:
        return encoder_files_key(checked.model_path, [*spec.text_encoders, *spec.tokenizers],
                                 load)
    # ComfyUI's split files: the encoder's file, its config and the tokenizer's folder
    from modules.models.split_files import tokenizer_folder
    return encoder_files_key(folder, list(spec.text_encoders), load,
                             (Path(config.model.text_encoder_path),
                              tokenizer_folder(config.model, folder)))


def split_config_folder(config: Config) -> Path | None:
    """The config folder ComfyUI's split files are built from, or None for a diffusers
    folder."""
    from modules.models.families import family_of
    from modules.models.single_file import is_single_file
    text_first = family_of(config.model.type).text_first
    if not is_single_file(config.model.path) or text_first is None \
            or text_first.split_config_folder is None:
        return None
    return text_first.split_config_folder(config.model)


def text_only_bundle(checked: CheckedRun, encoders: dict, tokenizers: dict) -> ModelBundle:
    """A bundle of the text encoders and tokenizers only, for encoding before the model
    loads."""
    return ModelBundle(checked.config.model.type, checked.model_path, None, None, encoders,
                       tokenizers, None)


def encode_with_encoder_alone(checked: CheckedRun, captions: list[str],
                              callbacks: TrainerCallbacks) -> tuple[TextEncoderCache, str]:
    """Load the text encoder alone, cache `captions` (those not on disk yet), release it;
    return the cache and the encoder's identity (`encoder_identity`)."""
    config = checked.config
    device = pick_device(config.general.device)
    callbacks.on_status("loading the text encoder alone: every caption is cached before the "
                        "model loads, and the encoder is released first")
    encoders, tokenizers = load_text_part(checked.model_path, config.model,
                                          component_dtypes(config))
    for name in stored_components(config):  # as prepare_trainable stores them: the same rows
        if name in encoders:
            store_weights(encoders[name].requires_grad_(False), config.model.weight_storage.value)
    text_only = text_only_bundle(checked, encoders, tokenizers)
    identity = encoder_identity(text_only)
    store = TextEmbeddingStore(checked.cache_dir / "text-embeddings", identity)
    cache = TextEncoderCache(text_only, device, store)
    for module in encoders.values():
        module.to(device)
    encoded = cache.precache(captions)
    release_text_encoders(cache, device)
    del encoders, text_only
    gc.collect()  # a reference cycle inside the model would otherwise keep it until later
    callbacks.on_status(f"text encoder outputs: {len(captions)} captions cached on disk "
                        f"({encoded} encoded now, {len(captions) - encoded} read from "
                        f"{store.folder}); the text encoder is released before the model "
                        "loads")
    return cache, identity


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
