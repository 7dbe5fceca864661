"""The run's inputs on disk, checked before anything is written: the model, the datasets and
the output folder. `prepare_run` (a real start, and the GUI's Start through it) and
`tempera-train --check` call `check_inputs`; `validate` checks the config's values without
opening any file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from modules.config.problems import Problem
from modules.config.prompts import sample_prompts
from modules.config.schema import Config, SaveFormat, TrainingMethod
from modules.data.captions import CaptionsFileError, load_captions_file
from modules.model_types import BUILTIN_PREFIX, MODEL_TYPES
from modules.models.family import check_folder
from modules.models.folder import (PICKLE_SUFFIXES, SAFETENSORS_SUFFIX, FolderError,
                                   check_weight_headers, weight_files)
from modules.util.disk import free_bytes, megabytes, nearest_existing

# A LoRA save is a small fraction of the model (rank 16-128 adapters on attention layers);
# bounded from above so a check never refuses a run that fits.
LORA_FRACTION = 0.05
MIN_FREE_BYTES = 16 * 2**20


def check_inputs(config: Config) -> list[Problem]:
    """Every problem with the model, datasets and output folder the config names."""
    return (_check_model_path(config) + _check_dataset_paths(config) + _check_output_dir(config)
            + _check_prompts_file(config) + _check_validation_folder(config))


def _check_validation_folder(config: Config) -> list[Problem]:
    """validation.folder exists (whether it holds images is the scan's to say)."""
    folder = config.validation.folder.strip()
    if not folder or Path(folder).is_dir():
        return []
    return [Problem("validation.folder", "an existing folder of validation images",
                    repr(folder), "not a folder" if Path(folder).exists() else "no such folder")]


def _check_prompts_file(config: Config) -> list[Problem]:
    """The prompts file can be read, and each of its lines parses (`sampling.prompts`' own
    lines are validate()'s)."""
    if not config.sampling.prompts_file:
        return []
    return [p for p in sample_prompts(config)[1] if p.path == "sampling.prompts_file"]


def estimated_save_bytes(config: Config) -> int:
    """About what one save of this run takes: the model's weights on disk (a fine-tune saves
    them in each format), or a fraction of them for a LoRA."""
    path = Path(config.model.path)
    if config.model.path.startswith(BUILTIN_PREFIX) or not path.exists():
        return MIN_FREE_BYTES
    if path.is_file():
        model = path.stat().st_size
    else:
        spec = MODEL_TYPES[config.model.type]
        model = sum(f.stat().st_size for f in weight_files(path, spec.components))
    formats = max(1, len(config.output.formats))
    if config.training.method == TrainingMethod.TEXTUAL_INVERSION:  # kilobytes of vectors
        return MIN_FREE_BYTES
    if config.training.method == TrainingMethod.LORA:
        return max(MIN_FREE_BYTES, int(model * LORA_FRACTION) * formats)
    single = SaveFormat.SINGLE_FILE in config.output.formats
    return max(MIN_FREE_BYTES, model * (formats if single else 1))


def _check_model_path(config: Config) -> list[Problem]:
    path, spec = config.model.path, MODEL_TYPES[config.model.type]
    if not path.strip() or path.startswith(BUILTIN_PREFIX):
        return []  # empty and builtin names are validate()'s (no disk needed)
    p = Path(path)
    if not p.exists():
        if p.suffix.lower() in (SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES):  # a file was meant
            return [Problem("model.path", "an existing checkpoint file", repr(path),
                            "no such file")]
        return [Problem("model.path", "an existing diffusers model folder or .safetensors "
                        "checkpoint", repr(path), "no such file or folder")]
    # imports torch: lazily, the front ends import this module before torch (test_layers)
    from modules.models.families import family_of
    own = family_of(config.model.type).input_problems
    if p.is_file():
        return own(config.model, True) if own else _check_single_file(config, p)
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
    return _check_folder(config, p) or (own(config.model, False) if own else [])


def _check_folder(config: Config, folder: Path) -> list[Problem]:
    """Every component folder there, of `model.type`'s family, weights readable."""
    try:
        check_folder(folder, config.model.type)
        check_weight_headers(folder, MODEL_TYPES[config.model.type].components)
    except FolderError as exc:
        text = str(exc)
        if "set model.type=" in text:
            found = text.rsplit("set model.type=", 1)[1]
            return [Problem("model.type", found, config.model.type.value, text)]
        return [Problem("model.path", f"a whole {MODEL_TYPES[config.model.type].label} "
                        "diffusers folder", repr(str(folder)), text)]
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
        if not ds.path.strip() or ds.path.startswith(BUILTIN_PREFIX):
            continue  # validate()'s
        if not Path(ds.path).is_dir():
            problems.append(Problem(where, "an existing folder of images", repr(ds.path),
                                    "not a folder" if Path(ds.path).exists() else "no such folder"))
    for i, ds in enumerate(config.data.datasets):
        if ds.captions_file:
            try:
                load_captions_file(Path(ds.captions_file))
            except CaptionsFileError as exc:
                problems.append(Problem(f"data.datasets[{i}].captions_file",
                                        "a readable .json or .jsonl captions file",
                                        repr(ds.captions_file), str(exc)))
    return problems




def _check_output_dir(config: Config) -> list[Problem]:
    if not config.output.dir.strip():
        return []  # reported by _check_output_and_sampling
    out = Path(config.output.dir)
    if out.exists() and not out.is_dir():
        return [Problem("output.dir", "a folder", repr(config.output.dir), "it is a file")]
    resuming = bool(config.training.resume_from.strip())  # continues the run that is there
    if (out / "run.json").exists() and not config.output.overwrite and not resuming:
        return [Problem("output.dir", "a folder without an earlier run (or output.overwrite = "
                        "true)", repr(config.output.dir),
                        "it holds an earlier run; choose another folder so nothing is lost")]
    return _check_output_writable(config, out)


def _check_output_writable(config: Config, out: Path) -> list[Problem]:
    """The folder can be created and written, with room for one save; nothing is written to
    find out (the nearest existing folder is asked)."""
    existing = nearest_existing(out)
    where = repr(config.output.dir)
    if not existing.is_dir():
        return [Problem("output.dir", "a folder that can be created", where,
                        f"{existing} is a file, so no folder can be made under it")]
    if not os.access(existing, os.W_OK | os.X_OK):
        reason = "it is on a read-only file system" if _read_only(existing) else \
            "this user may not write there"
        return [Problem("output.dir", "a folder this user can write", where,
                        f"{existing}: {reason}")]
    needed, free = estimated_save_bytes(config), free_bytes(existing)
    if free < needed:
        return [Problem("output.dir", "a disk with room for at least one save", where,
                        f"about {megabytes(needed)} needed, {megabytes(free)} free on the disk "
                        f"of {existing}")]
    return []


def _read_only(path: Path) -> bool:
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


