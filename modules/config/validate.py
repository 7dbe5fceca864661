"""`validate(config)`: the one consistency check used by the CLI, the GUI and cloud runs.

Type and range errors are caught when a config is loaded; this finds combinations that do not
make sense and inputs on disk that are missing, each as a Problem with its dotted path.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

from modules.config.problems import Problem
from modules.config.schema import (
    BUILTIN_PREFIX,
    BUILTIN_SHAPES,
    Config,
    DataConfig,
    Device,
    MixedPrecision,
    Optimizer,
    SaveFormat,
    TrainingMethod,
)
from modules.model_types import BUILTIN_DATASETS, MODEL_TYPES

SUPPORTED_FORMATS = {
    TrainingMethod.LORA: {SaveFormat.DIFFUSERS, SaveFormat.KOHYA},
    TrainingMethod.FINE_TUNE: {SaveFormat.DIFFUSERS, SaveFormat.SINGLE_FILE},
}
COMPONENT_NAMES = ("unet", "text_encoder", "text_encoder_2", "vae")
BUCKET_MAX_ASPECT_LIMIT = next(f.metadata["max"] for f in dataclasses.fields(DataConfig)
                               if f.name == "bucket_max_aspect")


def validate(config: Config, check_files: bool = True) -> list[Problem]:
    """Every problem with the config's combinations (and, with check_files, its inputs on disk)."""
    problems: list[Problem] = []
    problems += _check_components(config)
    problems += _check_training(config)
    problems += _check_data(config)
    problems += _check_output_and_sampling(config)
    if check_files:
        problems += _check_model_path(config)
        problems += _check_dataset_paths(config)
        problems += _check_output_dir(config)
    return problems


def _check_components(config: Config) -> list[Problem]:
    spec = MODEL_TYPES[config.model.type]
    problems = []
    for name in COMPONENT_NAMES:
        component = getattr(config.components, name)
        if component.train and name not in spec.components:
            problems.append(Problem(f"components.{name}.train", "false",
                                    "true", f"{spec.label} has no {name}"))
    if config.components.vae.train:
        problems.append(Problem("components.vae.train", "false", "true",
                                "Tempera trains the UNet and text encoders, not the VAE"))
    # The VAE is never trained, so training only the VAE also means nothing would be trained.
    if not any(getattr(config.components, n).train for n in spec.components if n != "vae"):
        problems.append(Problem("components", "at least one component with train = true",
                                "none", "nothing would be trained"))
    return problems


def _check_training(config: Config) -> list[Problem]:
    t = config.training
    problems = []
    if t.method == TrainingMethod.LORA and not t.lora_target_modules:
        problems.append(Problem("training.lora_target_modules", "at least one module name",
                                "[]", "LoRA needs layers to adapt"))
    if t.optimizer == Optimizer.ADAMW_8BIT and importlib.util.find_spec("bitsandbytes") is None:
        problems.append(Problem("training.optimizer", "ADAMW (bitsandbytes is not installed)",
                                "ADAMW_8BIT", "pip install bitsandbytes, or use ADAMW"))
    if config.general.device == Device.CPU and t.mixed_precision == MixedPrecision.FP16:
        problems.append(Problem("training.mixed_precision", "NO or BF16 on the CPU", "FP16",
                                "FP16 autocast needs a CUDA GPU"))
    if config.general.device == Device.CUDA and not _cuda_available():
        problems.append(Problem("general.device", "AUTO or CPU (no CUDA GPU is visible)",
                                "CUDA"))
    return problems


def _check_data(config: Config) -> list[Problem]:
    d = config.data
    problems = []
    if d.resolution % 64:
        problems.append(Problem("data.resolution", "a multiple of 64", str(d.resolution),
                                f"try {max(64, round(d.resolution / 64) * 64)}"))
    if not d.datasets:
        problems.append(Problem("data.datasets", "at least one dataset folder", "[]"))
    for i, ds in enumerate(d.datasets):
        if not ds.path.strip():
            problems.append(Problem(f"data.datasets[{i}].path",
                                    f"a folder of images or {BUILTIN_SHAPES}", repr(ds.path)))
    if d.aspect_buckets and d.resolution >= 64 and d.resolution % 64 == 0 \
            and d.bucket_max_aspect >= 1.0:  # out-of-range values are the loader's to report
        problems += _check_buckets(d.resolution, d.bucket_max_aspect)
    if d.cache_latents and not d.center_crop:
        problems.append(Problem("data.center_crop", "true when data.cache_latents is on", "false",
                                "a random crop would be frozen into the cached latents"))
    if d.cache_text_encoder_outputs and any(
            getattr(config.components, n).train for n in ("text_encoder", "text_encoder_2")):
        problems.append(Problem("data.cache_text_encoder_outputs",
                                "false while a text encoder is trained", "true",
                                "a trained encoder's outputs change every step"))
    if not d.caption_extension.startswith(".") or len(d.caption_extension) < 2:
        problems.append(Problem("data.caption_extension", "an extension such as '.txt'",
                                repr(d.caption_extension)))
    return problems


def _check_buckets(resolution: int, max_aspect: float) -> list[Problem]:
    """Bucketing that can only produce the square bucket is a mistake the user should hear of."""
    from modules.data.buckets import bucket_sizes, narrowest_non_square
    if len(bucket_sizes(resolution, max_aspect)) > 1:
        return []
    narrowest = narrowest_non_square(resolution)
    if narrowest is None or narrowest > BUCKET_MAX_ASPECT_LIMIT:
        hint = (f"at resolution {resolution} only the square bucket has sides that are "
                "multiples of 64; use a larger resolution (192 allows 2:3 buckets)")
    else:
        enough = math.ceil(narrowest * 100) / 100
        hint = (f"at resolution {resolution} the least elongated non-square bucket has aspect "
                f"{narrowest:.2f}; raise data.bucket_max_aspect to {enough} or the resolution")
    return [Problem("data.aspect_buckets", "a resolution and data.bucket_max_aspect that allow "
                    "more than the square bucket (or aspect_buckets = false)", "true", hint)]


def _check_output_and_sampling(config: Config) -> list[Problem]:
    problems = []
    if not config.output.formats:
        problems.append(Problem("output.formats", "at least one format", "[]"))
    supported = SUPPORTED_FORMATS[config.training.method]
    for i, fmt in enumerate(config.output.formats):
        if fmt not in supported:
            problems.append(Problem(f"output.formats[{i}]",
                                    " or ".join(sorted(f.value for f in supported)), fmt.value,
                                    f"{fmt.value} does not apply to {config.training.method.value}"))
    if not config.output.dir.strip():
        problems.append(Problem("output.dir", "a folder path", repr(config.output.dir)))
    if not config.model.path.strip():
        problems.append(Problem("model.path", "a diffusers model folder, a .safetensors "
                                "checkpoint or a builtin: model", repr(config.model.path),
                                "choose the base model to train"))
    if config.sampling.every_steps and not config.sampling.prompts:
        problems.append(Problem("sampling.prompts", "at least one prompt when sampling is on",
                                "[]"))
    for i, prompt in enumerate(config.sampling.prompts):
        if not prompt.strip():
            problems.append(Problem(f"sampling.prompts[{i}]", "a non-empty prompt", repr(prompt)))
    return problems


def _check_model_path(config: Config) -> list[Problem]:
    path, spec = config.model.path, MODEL_TYPES[config.model.type]
    builtins = {s.builtin: t for t, s in MODEL_TYPES.items()}
    if not path.strip():
        return []  # reported by _check_output_and_sampling without touching the disk
    if path.startswith(BUILTIN_PREFIX):
        if path not in builtins:
            return [Problem("model.path", "one of " + ", ".join(builtins), repr(path))]
        if builtins[path] != config.model.type:
            return [Problem("model.type", builtins[path].value, config.model.type.value,
                            f"{path} is a {MODEL_TYPES[builtins[path]].label} model")]
        return []
    p = Path(path)
    if not p.exists():
        return [Problem("model.path", "an existing diffusers model folder", repr(path),
                        "no such file or folder")]
    if p.is_file():
        return _check_single_file(config, p)
    index = p / "model_index.json"
    if not index.is_file():
        return [Problem("model.path", "a diffusers model folder (with model_index.json)",
                        repr(path), "it has no model_index.json")]
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError covers bad JSON and bad UTF-8
        return [Problem("model.path", "a readable model_index.json", f"{index} ({exc})")]
    cls = data.get("_class_name", "") if isinstance(data, dict) else ""
    if cls and cls != spec.pipeline_class:
        matching = [t.value for t, s in MODEL_TYPES.items() if s.pipeline_class == cls]
        if not matching:
            return [Problem("model.path", "a folder of a supported pipeline (" + ", ".join(
                sorted({s.pipeline_class for s in MODEL_TYPES.values()})) + ")",
                repr(path), f"its model_index.json names {cls}")]
        return [Problem("model.type", " or ".join(matching), config.model.type.value,
                        f"{path} holds a {cls}, not a {spec.pipeline_class}")]
    return []


def _check_single_file(config: Config, path: Path) -> list[Problem]:
    """A checkpoint file: its format, that it is a whole model of `model.type`, its tokenizer."""
    from modules.models.single_file import (
        SingleFileError,
        detect_model_type,
        find_tokenizer_folder,
        is_single_file,
    )
    if not is_single_file(path):
        return [Problem("model.path", "a diffusers model folder or a .safetensors checkpoint",
                        repr(str(path)), "unknown file type")]
    try:
        detect_model_type(path, expected=config.model.type, allow_pickle=config.model.allow_pickle)
    except SingleFileError as exc:
        return [Problem("model.path", f"a {MODEL_TYPES[config.model.type].label} checkpoint",
                        repr(str(path)), str(exc))]
    if config.model.config_path:
        return []  # the architecture folder may carry its own tokenizer; the loader checks it
    try:
        find_tokenizer_folder(path, config.model.type,
                              Path(config.model.tokenizer_path) if config.model.tokenizer_path
                              else None)
    except SingleFileError as exc:
        return [Problem("model.tokenizer_path", "a folder with the model's tokenizer",
                        repr(config.model.tokenizer_path), str(exc))]
    return []


def _check_dataset_paths(config: Config) -> list[Problem]:
    problems = []
    for i, ds in enumerate(config.data.datasets):
        where = f"data.datasets[{i}].path"
        if not ds.path.strip():
            continue  # reported by _check_data without touching the disk
        if ds.path.startswith(BUILTIN_PREFIX):
            if ds.path not in BUILTIN_DATASETS:
                problems.append(Problem(where, "one of " + ", ".join(BUILTIN_DATASETS),
                                        repr(ds.path)))
        elif not Path(ds.path).is_dir():
            problems.append(Problem(where, "an existing folder of images", repr(ds.path),
                                    "not a folder" if Path(ds.path).exists() else "no such folder"))
    return problems


def _check_output_dir(config: Config) -> list[Problem]:
    if not config.output.dir.strip():
        return []  # reported by _check_output_and_sampling
    out = Path(config.output.dir)
    if out.exists() and not out.is_dir():
        return [Problem("output.dir", "a folder", repr(config.output.dir), "it is a file")]
    resuming = bool(config.training.resume_from.strip())  # continues the run that is there
    if resuming and config.output.overwrite:
        return [Problem("output.overwrite", "false when training.resume_from is set", "true",
                        "overwriting would remove the run being resumed")]
    if (out / "run.json").exists() and not config.output.overwrite and not resuming:
        return [Problem("output.dir", "a folder without an earlier run (or output.overwrite = "
                        "true)", repr(config.output.dir),
                        "it holds an earlier run; choose another folder so nothing is lost")]
    return []


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()
