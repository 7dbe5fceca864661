"""The safetensors metadata that tools in this field read from saved LoRAs and checkpoints.

Two conventions, both str -> str (safetensors metadata holds only strings):
- `modelspec.*`, Stability AI's model spec (https://github.com/Stability-AI/ModelSpec), read by
  A1111/Forge/ComfyUI model browsers and by hubs to tell architecture and resolution;
- kohya-ss' `ss_*` training keys, read by A1111's LoRA info panel, Civitai and many extensions
  (network dim/alpha, base model version, training settings).
A `tempera.config` key keeps the full run config as JSON, so a file says how it was made.
"""
from __future__ import annotations

import datetime as dt
import json
import math
from enum import Enum
from pathlib import Path
from typing import Any

from modules.config.schema import ModelType
from modules.models.families import family_of
from modules.models.families.base import FileConventions

SAI_MODEL_SPEC_VERSION = "1.0.0"
# modelspec.implementation: LoRAs and single files follow the family's original layout (its
# FileConventions.modelspec_implementation), diffusers folders and peft-layout LoRAs diffusers'.
IMPL_DIFFUSERS = "diffusers"
KINDS = ("lora", "checkpoint", "embedding")
LAYOUTS = ("kohya", "single_file", "diffusers")

def conventions(model_type: ModelType) -> FileConventions:
    files = family_of(model_type).files
    if files is None:
        raise ValueError(f"{model_type.value} has no modelspec / kohya metadata conventions")
    return files


def modelspec_architecture(model_type: ModelType, v_prediction: bool, kind: str) -> str:
    """The modelspec architecture id, e.g. ``stable-diffusion-v1/lora`` (a textual inversion
    embedding: ``.../textual-inversion``, modelspec's name)."""
    arch = conventions(model_type).modelspec_architecture(v_prediction)
    suffix = {"lora": "/lora", "embedding": "/textual-inversion"}.get(kind, "")
    return arch + suffix


def training_metadata(config_dict: dict, model_type: ModelType, method: Any, kind: str,
                      layout: str = "kohya", prediction_type: str | None = None,
                      title: str | None = None, steps: int | None = None,
                      now: dt.datetime | None = None) -> dict[str, str]:
    """modelspec + kohya `ss_*` metadata for a file saved from the run described by `config_dict`.

    `config_dict` is `modules.config.loader.to_dict(config)`; `kind` is "lora" or "checkpoint";
    `layout` is how the file is laid out ("kohya", "single_file" or "diffusers");
    `prediction_type` is the resolved scheduler value ("epsilon" / "v_prediction") when the
    config says AUTO; `steps` the steps actually trained. LoRA-only `ss_network_*` keys are
    left out of checkpoints.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    model, data = config_dict.get("model", {}), config_dict.get("data", {})
    training = config_dict.get("training", {})
    v_pred = _is_v_prediction(prediction_type or _plain(model.get("prediction_type")), model_type)
    # the largest a run trained at (several resolutions: data.resolutions, a dataset's own)
    resolution = max([int(data.get("resolution", 0)), *map(int, data.get("resolutions") or []),
                      *(int(r) for ds in data.get("datasets") or []
                        for r in ds.get("resolutions") or [])])
    when = (now or dt.datetime.now(dt.timezone.utc)).replace(microsecond=0)
    files = conventions(model_type)
    meta = {
        "modelspec.sai_model_spec": SAI_MODEL_SPEC_VERSION,
        "modelspec.architecture": modelspec_architecture(model_type, v_pred, kind),
        "modelspec.implementation": (IMPL_DIFFUSERS if layout == "diffusers"
                                     else files.modelspec_implementation),
        "modelspec.title": title or _default_title(config_dict),
        "modelspec.resolution": f"{resolution}x{resolution}",
        "modelspec.date": when.isoformat(),
    }
    prediction = files.modelspec_prediction_type(v_pred)
    if prediction is not None:
        meta["modelspec.prediction_type"] = prediction
    max_steps = steps if steps is not None else training.get("max_steps", 0)
    meta.update({
        "ss_base_model_version": conventions(model_type).base_model_version,
        "ss_v2": str(conventions(model_type).kohya_v2),
        "ss_v_parameterization": str(v_pred),
        "ss_zero_terminal_snr": str(bool(model.get("zero_terminal_snr", False))),
        "ss_sd_model_name": Path(str(model.get("path", ""))).name,  # no local folders in shared files
        "ss_resolution": f"({resolution}, {resolution})",
        "ss_learning_rate": str(training.get("learning_rate", "")),
        "ss_unet_lr": str(_component_lr(config_dict, "denoiser")),
        "ss_text_encoder_lr": str(_component_lr(config_dict, "text_encoder")),
        "ss_max_train_steps": str(max_steps),
        "ss_num_epochs": str(training.get("epochs", "")),
        "ss_batch_size_per_device": str(training.get("batch_size", "")),
        "ss_gradient_accumulation_steps": str(training.get("gradient_accumulation", "")),
        "ss_gradient_checkpointing": str(bool(training.get("gradient_checkpointing", False))),
        "ss_lr_scheduler": str(_plain(training.get("lr_scheduler", ""))).lower(),
        "ss_lr_warmup_steps": str(training.get("lr_warmup_steps", "")),
        "ss_optimizer": str(_plain(training.get("optimizer", ""))),
        "ss_mixed_precision": str(_plain(training.get("mixed_precision", ""))).lower(),
        "ss_seed": str(training.get("seed", "")),
        "ss_training_started_at": str(int(when.timestamp())),
        "ss_training_comment": f"trained with Tempera ({_plain(method)})",
        "tempera.config": json.dumps(config_dict, sort_keys=True, default=_plain),
    })
    meta["ss_output_name"] = meta["modelspec.title"]  # A1111's name for the LoRA in prompts
    if kind == "lora":
        meta.update(network_metadata(training))
        if layout == "kohya":
            meta[MODEL_HASH_KEY] = MODEL_HASH_PLACEHOLDER  # stamp_model_hash fills it in
    return meta


def network_metadata(training: dict) -> dict[str, str]:
    """kohya's ss_network_* keys for the run's adapter: networks.lora for LoRA / LoCon (with
    conv_dim / conv_alpha, as kohya's LoCon writes them), lycoris.kohya with its algo for
    LoHa, LoKr and DoRA, as LyCORIS writes them (A1111's info panel and Civitai read them)."""
    from modules.config.adapters import ADAPTERS
    from modules.config.schema import Adapter

    row = ADAPTERS[Adapter(_plain(training.get("adapter", Adapter.LORA)))]
    rslora = bool(training.get("use_rslora")) and "use_rslora" in row.options
    args: dict[str, Any] = {"target_modules": training.get("lora_target_modules", [])}
    if row.convolutions and training.get("conv_rank", 0):
        args.update(conv_dim=str(training["conv_rank"]),
                    conv_alpha=_number(kohya_alpha(training.get("conv_alpha", ""),
                                                   training["conv_rank"], rslora)))
    if row.lycoris_algo:
        args["algo"] = row.lycoris_algo
    if _plain(training.get("adapter")) == Adapter.DORA.value:
        args["dora_wd"] = "True"
    for option in ("use_rslora", "lora_dropout", "module_dropout", "rank_dropout"):
        if training.get(option):
            args[option] = str(training[option])
    return {"ss_network_module": row.kohya_network_module,
            "ss_network_dim": str(training.get("lora_rank", "")),
            "ss_network_alpha": _number(kohya_alpha(training.get("lora_alpha", ""),
                                                    training.get("lora_rank", 1), rslora)),
            "ss_network_args": json.dumps(args)}


def kohya_alpha(alpha: Any, rank: Any, rslora: bool) -> Any:
    """The alpha a kohya file states for a layer of `rank`: the one its `alpha` tensors hold
    (modules/models/kohya.py). Readers scale by alpha / rank, so rsLoRA's alpha / sqrt(rank)
    is written as peft's scaling times the rank, alpha * sqrt(rank)."""
    if not rslora or not isinstance(alpha, (int, float)) or not isinstance(rank, int):
        return alpha
    return alpha / math.sqrt(rank) * rank  # as peft computes the scaling, times the rank


def a1111_card(model_type: ModelType, description: str, trigger_phrase: str,
               notes: str = "") -> dict[str, Any]:
    """The user metadata A1111 and Forge show on a LoRA's extra-networks card, which they read
    from `<LoRA file stem>.json` beside the file (their card editor writes the same file):
    "activation text" (added to the prompt with the LoRA: the trigger words), "sd version"
    (the card's filter), a description and notes. "preferred weight" 0 leaves the weight to
    the user's default."""
    return {"description": description, "sd version": conventions(model_type).a1111_sd_version,
            "activation text": trigger_phrase, "preferred weight": 0, "notes": notes}


def tag_frequency(captions: list[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """{dataset folder name: {tag: images whose caption holds it}} from (folder, caption as
    trained) pairs; tags are split at commas and stripped, as kohya counts them."""
    counts: dict[str, dict[str, int]] = {}
    for folder, caption in captions:
        own = counts.setdefault(folder, {})
        for tag in dict.fromkeys(t.strip() for t in caption.split(",")):
            if tag:
                own[tag] = own.get(tag, 0) + 1
    return counts


def dataset_metadata(captions: list[tuple[str, str]], folders: dict[str, tuple[int, int]],
                     trigger_words: list[str]) -> dict[str, str]:
    """The keys A1111's and Forge's extra-networks panels read about the training data:
    `ss_tag_frequency` (their tag list and random prompt), `ss_dataset_dirs` (the dataset size
    shown), `ss_num_train_images` (images per epoch, repeats counted), and the trigger words as
    modelspec.trigger_phrase. `folders` is {folder name: (repeats, images)}."""
    meta = {
        "ss_tag_frequency": json.dumps(tag_frequency(captions), ensure_ascii=False),
        "ss_dataset_dirs": json.dumps({name: {"n_repeats": repeats, "img_count": images}
                                       for name, (repeats, images) in folders.items()},
                                      ensure_ascii=False),
        "ss_num_train_images": str(sum(r * n for r, n in folders.values())),
    }
    words = [w.strip() for w in trigger_words if w.strip()]
    if words:
        meta["modelspec.trigger_phrase"] = ", ".join(dict.fromkeys(words))
    return meta


MODEL_HASH_KEY = "sshs_model_hash"
MODEL_HASH_PLACEHOLDER = "0" * 64


def stamp_model_hash(path: Path) -> str:
    """Fill in `sshs_model_hash`: the sha256 of the file's bytes after its header, the hash
    A1111 shows for a LoRA (its "addnet" hash). The header held a placeholder of the same
    length, so it is patched in place and the data bytes the hash covers do not move."""
    import hashlib
    import re

    with open(path, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        header = f.read(length)
        digest = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
        found = re.search(rb'"%s"\s*:\s*"(%s)"' % (MODEL_HASH_KEY.encode(),
                                                   MODEL_HASH_PLACEHOLDER.encode()), header)
        if found is None:
            raise ValueError(f"{path}: no {MODEL_HASH_KEY} placeholder in the header")
        f.seek(8 + found.start(1))
        f.write(digest.hexdigest().encode())
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def _is_v_prediction(prediction_type: Any, model_type: ModelType) -> bool:
    value = str(prediction_type or "AUTO").lower()
    if value in ("auto", ""):
        # AUTO follows the base model's scheduler; of the built-in configs only SD 2 (768-v)
        # predicts v. Callers that know the loaded scheduler pass `prediction_type`.
        return conventions(model_type).predicts_v_by_default
    return value in ("v", "v_prediction")


def _component_lr(config_dict: dict, name: str) -> Any:
    component = config_dict.get("components", {}).get(name, {})
    if component.get("learning_rate") is not None:
        return component["learning_rate"]
    return config_dict.get("training", {}).get("learning_rate", "")


def _number(value: Any) -> str:
    """kohya writes alpha as a number; 16.0 reads better as '16.0' than '16'."""
    return str(float(value)) if isinstance(value, (int, float)) else str(value)


def _default_title(config_dict: dict) -> str:
    out_dir = str(config_dict.get("output", {}).get("dir", "")).rstrip("/\\")
    return out_dir.replace("\\", "/").rsplit("/", 1)[-1] or "tempera"
