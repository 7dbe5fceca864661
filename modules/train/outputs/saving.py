"""How what a run trained is saved, atomically: LoRA files (diffusers/peft and kohya layouts,
with the A1111 card), full models (a diffusers folder, an ldm single file), and the pipeline
samples are drawn with."""
from __future__ import annotations

import inspect
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from modules.config.schema import Config, SaveFormat, TrainingMethod
from modules.config.secret_settings import shared_config, shared_name
from modules.model_types import MODEL_TYPES
from modules.models.bundle import ModelBundle
from modules.models.families import family_files
from modules.models.precision import SAVE_DTYPES, cast_for_saving, cast_weight_files
from modules.models.single_file import clip_key_with_text_model, rename_weight_keys
from modules.train.state.resume_offer import SAVED_STEP_FILE
from modules.train.recipe.trainable import trained_components
from modules.util.atomic import atomic_write_dir

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
logger = logging.getLogger("tempera.train")
KOHYA_WEIGHT_NAME = "lora_kohya.safetensors"
# The base model's hash keys (modules/models/model_hash.py), in every LoRA file and single file
MODEL_HASH_KEYS = ("ss_sd_model_hash", "ss_new_sd_model_hash")
SINGLE_FILE_NAME = "model.safetensors"


def lora_save_dtype(config: Config) -> torch.dtype:
    """The dtype LoRA files are written in: output.save_dtype, or float32 (AS_TRAINED: lossless
    for adapters trained in any dtype, and small)."""
    return SAVE_DTYPES[config.output.save_dtype] or torch.float32


def write_lora_diffusers(bundle: ModelBundle, config: Config, folder: Path,
                         extra: dict[str, str] | None = None) -> Path:
    """LoRA adapters in the diffusers/peft layout (`load_lora_weights` reads it).

    The peft state dict is saved as it is: diffusers' conversion to its older key names only
    covers attention layers, and a file mixing both namings loses the other layers on load.
    The base model is named, never by its local path (peft records the folder it was loaded
    from as `base_model_name_or_path`): its name, and beside the adapters' metadata
    `ss_sd_model_name` with a single-file base's hashes from `extra`, as the kohya file says.
    """
    import diffusers
    from peft.utils import get_peft_model_state_dict

    from modules.models.kohya import adapter_config

    # each pipeline's LoRA loader mixin has the saver its own loader reads
    pipeline_cls = getattr(diffusers, MODEL_TYPES[config.model.type].pipeline_class)
    model_name = shared_name(config.model.path)
    kwargs: dict[str, dict] = {}
    for name in trained_components(config):
        module = bundle.component(name)
        # Text encoder keys in the `text_model.` form every stack reads (transformers 5.6+
        # flattened CLIPTextModel's names; older loaders crash on the flattened ones).
        rename = clip_key_with_text_model if name.startswith("text_encoder") else str
        # save_embedding_layers=False: no adapter here resizes an embedding, and peft's "auto"
        # asks the Hugging Face hub for the base model's config to find out (a network lookup
        # at every save, which fails offline with a warning)
        layers = cast_for_saving(get_peft_model_state_dict(module, save_embedding_layers=False),
                                 lora_save_dtype(config), name)
        kwargs[f"{name}_lora_layers"] = {rename(k): v for k, v in layers.items()}
        kwargs[f"{name}_lora_adapter_metadata"] = {
            **adapter_config(module).to_dict(), "base_model_name_or_path": model_name}
    pipeline_cls.save_lora_weights(save_directory=folder, weight_name=LORA_WEIGHT_NAME,
                                   safe_serialization=True, **kwargs)
    path = folder / LORA_WEIGHT_NAME
    add_file_metadata(path, {"ss_sd_model_name": model_name,
                             **{k: v for k, v in (extra or {}).items() if k in MODEL_HASH_KEYS}})
    return path


def add_file_metadata(path: Path, entries: dict[str, str]) -> None:
    """Add `entries` to a .safetensors file's metadata (rewritten in place: the file is in
    the save's temporary folder, and a LoRA is small)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    tensors = load_file(str(path))
    save_file(tensors, str(path), metadata={**metadata, **entries})


def hashes_base_model(config: Config) -> bool:
    """Whether a save of this run names the base model's hashes (hashing reads the whole
    base checkpoint, so a run does it only then): every LoRA file, and a single-file
    fine-tune."""
    if config.training.method == TrainingMethod.LORA:
        return True
    return SaveFormat.SINGLE_FILE in config.output.formats


def write_lora_kohya(bundle: ModelBundle, config: Config, folder: Path, step: int,
                     extra: dict[str, str] | None = None, replaces: Path | None = None,
                     warn: Callable[[str], None] = logger.warning) -> Path:
    """LoRA adapters in the kohya layout ComfyUI and A1111 read, with training metadata, and
    beside it the card A1111 / Forge show for it (`lora_kohya.json`: trigger words, SD
    version; modules/models/metadata.py `a1111_card`). `replaces` is the folder this save
    will replace: the user's edits to its card are kept (modules/models/a1111_card.py)."""
    from modules.models.kohya import save_kohya_lora
    from modules.models.metadata import a1111_card
    path = folder / KOHYA_WEIGHT_NAME
    meta = {**_metadata(bundle, config, "lora", "kohya", step), **(extra or {})}
    save_kohya_lora({n: bundle.component(n) for n in trained_components(config)}, path,
                    config.training.lora_alpha, config.model.type, meta,
                    dtype=lora_save_dtype(config))
    card = a1111_card(config.model.type, _card_description(config, step),
                      meta.get("modelspec.trigger_phrase", ""),
                      f"Base model: {shared_name(config.model.path)}")
    write_card(card, path.with_suffix(".json"), replaces, warn)
    return path


def write_card(card: dict, path: Path, replaces: Path | None,
               warn: Callable[[str], None]) -> None:
    """Write the A1111 card at `path`, merged with the card of the folder being replaced; an
    unreadable old card (or an earlier .bak of one) is carried into the new folder as .bak."""
    from modules.models.a1111_card import merge_card
    update = merge_card(card, replaces / path.name) if replaces else None
    if update is not None:
        card = update.card
    backup = path.with_name(path.name + ".bak")
    if update is not None and update.backup is not None:
        backup.write_text(update.backup, encoding="utf-8")
        if update.warning:  # merge_card sets it with the backup
            warn(update.warning)
    elif replaces and (replaces / backup.name).is_file():
        shutil.copy2(replaces / backup.name, backup)
    path.write_text(json.dumps(card, indent=4, ensure_ascii=False) + "\n", encoding="utf-8")


def _card_description(config: Config, step: int) -> str:
    from modules.config.adapters import ADAPTERS
    adapter = ADAPTERS[config.training.adapter].label
    return (f"{adapter} for {MODEL_TYPES[config.model.type].label}, trained with Tempera for "
            f"{step} steps.")


def write_full_diffusers(bundle: ModelBundle, config: Config, folder: Path) -> Path:
    """The whole model as a diffusers folder (`from_pretrained` reads it), readable by older
    stacks too: text encoder weights under their `text_model.` names, and the tokenizers' slow
    files (vocab.json, merges.txt) beside tokenizer.json."""
    build_pipeline(bundle, config).save_pretrained(folder, safe_serialization=True)
    spec = MODEL_TYPES[config.model.type]
    if (dtype := SAVE_DTYPES[config.output.save_dtype]) is not None:
        for name in spec.components:
            cast_weight_files(folder / name, dtype)
    for name in spec.text_encoders:
        rename_weight_keys(folder / name, clip_key_with_text_model)
    for name in spec.tokenizers:
        write_slow_tokenizer_files(bundle.tokenizers[name], folder / name)
    name_base_model(folder, shared_name(config.model.path))
    return folder


# Where diffusers' and transformers' saved configs record the folder a model was loaded from.
NAME_OR_PATH_KEYS = ("_name_or_path", "name_or_path")


def name_base_model(folder: Path, model_name: str) -> None:
    """Replace the local folder diffusers and transformers write into each component's
    config (`_name_or_path`: where the component was loaded from) by the model's name."""
    for path in sorted(folder.rglob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and any(data.get(key) for key in NAME_OR_PATH_KEYS):
            data.update({key: model_name for key in NAME_OR_PATH_KEYS if data.get(key)})
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n",
                            encoding="utf-8")


def write_slow_tokenizer_files(tokenizer, folder: Path) -> None:
    """vocab.json and merges.txt (what CLIPTokenizer, the slow one, reads) from a fast BPE
    tokenizer, when save_pretrained wrote only tokenizer.json."""
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"cannot write the slow tokenizer files of {type(tokenizer).__name__}")
    backend.model.save(str(folder))


def write_full_single_file(bundle: ModelBundle, config: Config, folder: Path, step: int,
                           extra: dict[str, str] | None = None) -> Path:
    """The whole model as one .safetensors in the original SD/SDXL layout."""
    from modules.models.families import family_of
    from modules.models.single_file import save_single_file
    path = folder / SINGLE_FILE_NAME
    own = family_of(config.model.type).write_single_file
    if own is not None:  # a family whose single file is not the ldm layout
        return own(bundle, path, {**_metadata(bundle, config, "checkpoint", "single_file", step),
                                  **(extra or {})}, SAVE_DTYPES[config.output.save_dtype])
    components = {**bundle.components(), "scheduler": bundle.noise_scheduler}
    save_single_file(components, path, family_files(config.model.type),
                     {**_metadata(bundle, config, "checkpoint", "single_file", step),
                      **(extra or {})},
                     dtype=SAVE_DTYPES[config.output.save_dtype])
    return path


def _metadata(bundle: ModelBundle, config: Config, kind: str, layout: str, step: int) -> dict:
    from modules.models.metadata import training_metadata
    # secret-looking values masked and paths reduced to names: a weights file is shared
    return training_metadata(shared_config(config), config.model.type, config.training.method,
                             kind, layout=layout, prediction_type=bundle.prediction_type,
                             steps=step)


def save_weights(bundle: ModelBundle, config: Config, folder: Path, step: int,
                 extra_metadata: dict[str, str] | None = None,
                 warn: Callable[[str], None] = logger.warning) -> list[Path]:
    """Save what this run trains into `folder`, in every configured format, atomically.

    Everything is written into a temporary folder first and swapped in at the end, so an
    interrupted save leaves the previous checkpoint of that name intact. `extra_metadata`
    (what the run knows about its data, train/outputs/data_metadata.py) goes into the files that
    carry training metadata.
    """
    from modules.train.outputs.embedding_files import (write_embedding_a1111,
                                                       write_embedding_diffusers)
    formats = set(config.output.formats)
    lora = config.training.method == TrainingMethod.LORA
    embedding = config.training.method == TrainingMethod.TEXTUAL_INVERSION
    full = not lora and not embedding
    writers = [
        (lora and SaveFormat.DIFFUSERS in formats,
         lambda t: write_lora_diffusers(bundle, config, t, extra_metadata)),
        (lora and SaveFormat.KOHYA in formats, lambda t: write_lora_kohya(bundle, config, t, step, extra_metadata,
                                   replaces=folder, warn=warn)),
        (full and SaveFormat.DIFFUSERS in formats,
         lambda t: write_full_diffusers(bundle, config, t)),
        (full and SaveFormat.SINGLE_FILE in formats,
         lambda t: write_full_single_file(bundle, config, t, step, extra_metadata)),
        (embedding and SaveFormat.DIFFUSERS in formats,
         lambda t: write_embedding_diffusers(bundle, config, t, step, extra_metadata)),
        (embedding and SaveFormat.KOHYA in formats,
         lambda t: write_embedding_a1111(bundle, config, t, step, extra_metadata)),
    ]
    written: list[Path] = []

    def write(tmp: Path) -> None:
        for wanted, writer in writers:
            if wanted:
                written.append(folder / writer(tmp).relative_to(tmp))
        # the step these weights hold, swapped in with them: a resumed run reads it before
        # it saves final/ (outputs.save_final), so an older segment never replaces newer weights
        (tmp / SAVED_STEP_FILE).write_text(json.dumps({"step": step}) + "\n", encoding="utf-8")

    atomic_write_dir(folder, write)
    return written


def build_pipeline(bundle: ModelBundle, config: Config, scheduler=None,
                   without_text_encoders: bool = False):
    """A diffusers pipeline over the bundle's (possibly LoRA-adapted) live components;
    `without_text_encoders`: for prompts handed over encoded (the encoders are off the
    device)."""
    import diffusers

    spec = MODEL_TYPES[config.model.type]
    cls = getattr(diffusers, spec.pipeline_class)
    parts = {**folder_pipeline_settings(bundle.path), **bundle.components(),
             "scheduler": scheduler or bundle.noise_scheduler, **bundle.tokenizers}
    if without_text_encoders:
        parts.update({name: None for name in spec.text_encoders})
    # the optional parts a pipeline may take and a training run never has (SD's safety checker,
    # IP-Adapter's image encoder): off, for whichever of them this pipeline class takes
    parts.update(safety_checker=None, feature_extractor=None, image_encoder=None,
                 requires_safety_checker=False)
    known = set(inspect.signature(cls.__init__).parameters)
    return cls(**{k: v for k, v in parts.items() if k in known})



def folder_pipeline_settings(path: Path) -> dict:
    """The pipeline's own settings that the model folder's model_index.json holds (Flux.2
    Klein's `is_distilled`, which turns its pipeline's CFG off; SDXL's
    `force_zeros_for_empty_prompt`), so that samples and a saved folder behave as the
    pipeline loaded from that folder does. Components (a [library, class] pair) and
    diffusers' own bookkeeping ("_class_name", "_diffusers_version") are not settings. A
    single file or a folder without model_index.json has none."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return {}
    data = json.loads(index.read_text(encoding="utf-8"))
    return {key: value for key, value in data.items()
            if not key.startswith("_") and not isinstance(value, list)}
