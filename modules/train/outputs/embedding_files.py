"""A TEXTUAL_INVERSION run's embedding files (docs/textual_inversion.md):

- KOHYA: the file A1111 / Forge and ComfyUI load from their embeddings folder (the one kohya's
  sd-scripts write): `emb_params` (vectors x 768 or 1024) for SD 1.x / 2.x, `clip_l` and
  `clip_g` for SDXL; its name, less the extension, is what a prompt writes in A1111
  (`embedding:<name>` in ComfyUI).
- DIFFUSERS: `learned_embeds.safetensors`, {trigger word: vectors}, as diffusers' own training
  script saves it and `load_textual_inversion` reads it; SDXL's second encoder's in
  `learned_embeds_2.safetensors` (loaded with `text_encoder=pipe.text_encoder_2,
  tokenizer=pipe.tokenizer_2`).

Both carry the trigger word, the vectors per token, the base model and the steps in their
metadata, besides the run's modelspec / ss_* keys.
"""
from __future__ import annotations

import re
from pathlib import Path

from modules.config.schema import Config
from modules.config.secret_settings import shared_config, shared_name
from modules.model_types import MODEL_TYPES
from modules.models.bundle import ModelBundle
from modules.train.recipe.textual_inversion import (SDXL_EMBEDDING_KEYS, SINGLE_EMBEDDING_KEY,
                                                    learned_vectors)

DIFFUSERS_EMBEDDING_NAMES = {"text_encoder": "learned_embeds.safetensors",
                             "text_encoder_2": "learned_embeds_2.safetensors"}


def embedding_file_name(config: Config) -> str:
    """The A1111 / ComfyUI file's name: the trigger word without the characters file names
    and prompts trip on (<mychar> -> mychar.safetensors)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "", config.textual_inversion.placeholder).strip(".")
    return f"{stem or 'embedding'}.safetensors"


def embedding_metadata(bundle: ModelBundle, config: Config, layout: str, step: int,
                       extra: dict[str, str] | None = None) -> dict[str, str]:
    from modules.models.metadata import training_metadata
    ti = config.textual_inversion
    meta = training_metadata(shared_config(config), config.model.type, config.training.method,
                             "embedding", layout=layout, prediction_type=bundle.prediction_type,
                             steps=step)
    meta.update({"modelspec.trigger_phrase": ti.placeholder,
                 "tempera.trigger_word": ti.placeholder,
                 "tempera.vectors_per_token": str(ti.vectors),
                 "tempera.initializer": ti.initializer,
                 "tempera.base_model": shared_name(config.model.path),
                 "tempera.steps": str(step)})
    meta.update({k: v for k, v in (extra or {}).items() if k.startswith("ss_")})
    return meta


def write_embedding_a1111(bundle: ModelBundle, config: Config, folder: Path, step: int,
                          extra: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file
    vectors = learned_vectors(bundle, config)
    if len(vectors) == 1:
        tensors = {SINGLE_EMBEDDING_KEY: next(iter(vectors.values()))}
    else:
        tensors = {SDXL_EMBEDDING_KEYS[name]: v for name, v in vectors.items()}
    path = folder / embedding_file_name(config)
    save_file(tensors, str(path), metadata=embedding_metadata(bundle, config, "kohya", step,
                                                              extra))
    return path


def write_embedding_diffusers(bundle: ModelBundle, config: Config, folder: Path, step: int,
                              extra: dict[str, str] | None = None) -> Path:
    """learned_embeds.safetensors (and SDXL's learned_embeds_2.safetensors); returns the
    first."""
    from safetensors.torch import save_file
    meta = embedding_metadata(bundle, config, "diffusers", step, extra)
    paths = []
    for name, vectors in learned_vectors(bundle, config).items():
        path = folder / DIFFUSERS_EMBEDDING_NAMES[name]
        save_file({config.textual_inversion.placeholder: vectors}, str(path), metadata=meta)
        paths.append(path)
    assert MODEL_TYPES[config.model.type].text_encoders[0] == "text_encoder"
    return paths[0]
