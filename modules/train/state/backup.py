"""Backups: everything a run needs to continue bit-for-bit where it stopped.

A backup is one folder `<output>/backups/step-NNNNNN/` written atomically (built under a hidden
temporary name, renamed into place last): `backup.json` (format, step, the resolved config, the
JSON structure of every state) beside `tensors.safetensors` (every tensor of that structure).
No pickle: a backup can be inspected with any safetensors reader and loading one runs no code.

What it holds is what `Run` owns and the config does not rebuild, as `Run.state_dict` gives it
(and `Run.load_state_dict` takes it back): the trained parameters, the optimizer, the LR
schedule, the GradScaler, the EMA weights, `TrainingState` (step, epoch, position in the epoch,
loss smoothing) and every global random state (Python, numpy, torch CPU and CUDA). This module
keeps the file format: writing, reading, checking, finding and rotating backups. Each step's own draws need nothing saved: their generator is seeded from (seed, rank,
step). The state saved is the one at the last optimizer-step boundary (`BoundaryState`), so a
backup written after a failure mid-window is still exact.

A backup is checked twice: when written (a tensor holding NaN or inf refuses the write, so the
previous good backup stays the newest) and when read (`verify_backup`: both files parse, every
tensor the structure names is there and finite). `resume_point` passes over a damaged backup
for "latest" and names it; a damaged backup named explicitly is an error.
"""
from __future__ import annotations

import json
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from modules.config.fields import OnResume
from modules.config.introspect import on_resume
from modules.config.migrations import migrate
from modules.config.schema import Config
from modules.train.state.backup_files import (INFO, TENSORS, BackupError, backups_folder,
                                              find_backup, list_backups)
from modules.util.atomic import atomic_write_dir

FORMAT = 1


class NonFiniteBackup(BackupError):
    """A backup was not written because some of its tensors hold NaN or inf."""


# ---------------------------------------------------------------- checking what a backup holds
def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors that hold a NaN or an inf (integer tensors, such as
    the random generators' states, cannot)."""
    return [key for key, tensor in tensors.items()
            if (tensor.is_floating_point() or tensor.is_complex())
            and not bool(torch.isfinite(tensor).all())]


def describe_tensors(keys: list[str], limit: int = 3) -> str:
    """A few tensor keys in words, e.g. "s.parameters.unet.x#0, s.ema... (and 4 more)"."""
    shown = ", ".join(keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def tensor_keys(structure: Any) -> list[str]:
    """Every tensor key a backup.json structure names (what tensors.safetensors must hold)."""
    if isinstance(structure, list):
        return [k for v in structure for k in tensor_keys(v)]
    if not isinstance(structure, dict):
        return []
    if "__tensor__" in structure:
        return [structure["__tensor__"]]
    return [k for v in structure.values() for k in tensor_keys(v)]


# ---------------------------------------------------------------- JSON + tensors, no pickle
def flatten(value: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """`value` as JSON, with each tensor moved into `tensors` under a key derived from `prefix`.

    Dicts with non-string keys (an optimizer's per-parameter state), tuples and numpy arrays
    are tagged so `unflatten` gives back exactly the types that went in.
    """
    if isinstance(value, torch.Tensor):
        key = f"{prefix}#{len(tensors)}"
        tensors[key] = value.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": flatten(torch.from_numpy(value.copy()), tensors, prefix)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: flatten(v, tensors, f"{prefix}.{k}") for k, v in value.items()}
        return {"__items__": [[k, flatten(v, tensors, f"{prefix}.{k}")] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [flatten(v, tensors, f"{prefix}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [flatten(v, tensors, f"{prefix}.{i}") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise BackupError(f"cannot store a {type(value).__name__} at {prefix} in a backup")


def unflatten(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [unflatten(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return unflatten(value["__ndarray__"], tensors).numpy()
    if "__tuple__" in value:
        return tuple(unflatten(v, tensors) for v in value["__tuple__"])
    if "__items__" in value:
        return {k: unflatten(v, tensors) for k, v in value["__items__"]}
    return {k: unflatten(v, tensors) for k, v in value.items()}


# ---------------------------------------------------------------- random states
def random_states() -> dict[str, Any]:
    """Every global generator that code run by a step might draw from (Tempera's own draws use
    their own generator; library code may use these)."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_random_states(states: dict[str, Any]) -> None:
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


@dataclass
class BoundaryState:
    """The run's small states as they were right after the last optimizer step.

    Taken once per step (a few kilobytes, no device sync; every value is a fresh copy): a
    failure in the middle of the next accumulation window may already have advanced the global
    generators, and a backup must not include that.
    """
    training: dict
    random: dict

    @classmethod
    def capture(cls, training: dict) -> "BoundaryState":
        """`training` is the TrainingState's state_dict, taken now."""
        return cls(training=training, random=random_states())


def save_backup(states: dict[str, Any], config: Config, output_dir: Path, reason: str) -> Path:
    """Write a run's states (`Run.state_dict`: its step is `states["training"]["step"]`) as a
    backup of `output_dir`, with the config masked, and remove the oldest beyond
    `output.keep_backups`. Returns the folder."""
    step = states["training"]["step"]
    folder = backups_folder(output_dir) / f"step-{step:06d}"
    tensors: dict[str, torch.Tensor] = {}
    structure = flatten(states, tensors, "s")
    bad = non_finite(tensors)  # checked before anything is written: the last good one stays
    if bad:
        raise NonFiniteBackup(f"the backup at step {step} was not written: "
                              f"{len(bad)} of its {len(tensors)} tensors hold NaN or inf "
                              f"({describe_tensors(bad)})")
    from modules.config.secret_settings import masked_config
    info = {"format": FORMAT, "step": step, "reason": reason,
            "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": masked_config(config),
            "states": structure}

    def write(tmp: Path) -> None:
        from safetensors.torch import save_file
        save_file(tensors, str(tmp / TENSORS))
        # backup.json last: a folder without it is not a backup (see `list_backups`)
        (tmp / INFO).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")

    atomic_write_dir(folder, write)
    rotate_backups(output_dir, config.output.keep_backups, step)
    return folder


def read_info(folder: Path) -> dict:
    """backup.json, or BackupError naming the file and why it cannot be read."""
    path = folder / INFO
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BackupError(f"{path}: cannot be read ({exc})") from exc
    if not isinstance(info, dict) or not {"format", "step", "states"} <= set(info):
        raise BackupError(f"{path}: not a backup description (format, step and states missing)")
    if info["format"] != FORMAT:
        raise BackupError(f"{path}: backup format {info['format']!r}, this Tempera reads "
                          f"format {FORMAT}")
    return info


def check_tensors(folder: Path, info: dict, tensors: dict[str, torch.Tensor]) -> None:
    """BackupError unless every tensor backup.json names is in `tensors` and is finite."""
    path = folder / TENSORS
    missing = [key for key in tensor_keys(info["states"]) if key not in tensors]
    if missing:
        raise BackupError(f"{path}: {len(missing)} tensor(s) that {INFO} names are missing "
                          f"({describe_tensors(missing)})")
    bad = non_finite(tensors)
    if bad:
        raise BackupError(f"{path}: {len(bad)} tensor(s) hold NaN or inf "
                          f"({describe_tensors(bad)})")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """tensors.safetensors, or BackupError naming the file (a truncated file is
    safetensors' own SafetensorError, not an OSError)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = folder / TENSORS
    try:
        return load_file(str(path))
    except (OSError, ValueError, SafetensorError) as exc:
        raise BackupError(f"{path}: cannot be read ({exc})") from exc


def verify_backup(folder: Path) -> dict:
    """Read a whole backup and check it (`check_tensors`) before anything is written; return
    its info. The tensors are dropped again: the run loads them once it is built."""
    info = read_info(folder)
    check_tensors(folder, info, _read_tensors(folder))
    return info


def load_states(folder: Path) -> tuple[dict, dict]:
    """(backup.json's info, its states with tensors restored), checked as `verify_backup`."""
    info = read_info(folder)
    tensors = _read_tensors(folder)
    check_tensors(folder, info, tensors)
    return info, unflatten(info["states"], tensors)


# ---------------------------------------------------------------- which config changes are allowed
def config_differences(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(fields that must match but differ, fields that differ and may) as "key: old -> new".

    Each field's rule is its `on_resume` metadata in the schema (modules/config/fields.py:
    OnResume); the saved config is first brought to the current schema version."""
    problems: list = []
    saved = migrate(dict(saved), problems) if saved else saved
    blocking, allowed = leaf_differences(saved, current)
    return [str(problem) for problem in problems] + blocking, allowed


def leaf_differences(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """`config_differences` of a saved config already at the current schema version."""
    blocking: list[str] = []
    allowed: list[str] = []
    before, after = _leaves(saved), _leaves(current)
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        rule = on_resume(key)
        if old == new or rule is OnResume.IGNORED:
            continue
        line = f"{key}: {old!r} -> {new!r}"
        (blocking if rule is OnResume.MUST_MATCH else allowed).append(line)
    return blocking, allowed


def builtins_by_identity(config: dict) -> dict:
    """`config` (a resolved config as a dict) with each built-in model's and dataset's cache
    folder replaced by what it is (name and fingerprint): a resume with another
    general.cache_dir trains the same model on the same images and must not be refused for
    their paths, while a changed built-in (another fingerprint) still is."""
    from modules.data.shapes import builtin_dataset_identity
    from modules.models.tiny import builtin_identity
    out = dict(config)
    model = config.get("model")
    if isinstance(model, dict) and builtin_identity(str(model.get("path", ""))):
        out["model"] = {**model, "path": builtin_identity(str(model["path"]))}
    data = config.get("data")
    if isinstance(data, dict) and isinstance(data.get("datasets"), list):
        out["data"] = {**data, "datasets": [
            {**ds, "path": builtin_dataset_identity(str(ds.get("path", ""))) or ds.get("path")}
            if isinstance(ds, dict) else ds for ds in data["datasets"]]}
    return out


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@dataclass(frozen=True)
class ResumePoint:
    """The backup a run continues from, found and checked before anything is written."""
    folder: Path
    step: int
    changed: list[str]  # config fields that differ from the backup's and may
    skipped: list[str] = field(default_factory=list)  # newer damaged backups passed over, why


def resume_point(output_dir: Path, resume_from: str, current: dict) -> ResumePoint:
    """The backup `resume_from` names, read whole, checked intact and against the current
    (resolved) config.

    "latest" is the newest intact backup: damaged newer ones are passed over and listed in
    `skipped`. A folder named explicitly must be intact. Raises BackupError naming the file and
    what is wrong, or every field that must match and does not."""
    skipped: list[str] = []
    if resume_from == "latest":
        folder, info = None, {}
        for _, candidate in reversed(list_backups(output_dir)):
            try:
                info = verify_backup(candidate)
            except BackupError as exc:
                skipped.append(str(exc))
                continue
            folder = candidate
            break
        if folder is None:
            if not skipped:
                raise BackupError(f"no backup to resume in {backups_folder(output_dir)}")
            raise BackupError(f"no intact backup to resume in {backups_folder(output_dir)}: "
                              + "; ".join(skipped))
    else:
        folder = find_backup(output_dir, resume_from)
        info = verify_backup(folder)
    # Migrated once, here: a backup written before a rename compares under today's names
    # (the built-ins are found by their keys), and one from a newer Tempera says so.
    problems: list = []
    saved = migrate(dict(info.get("config", {})), problems)
    blocking, allowed = leaf_differences(builtins_by_identity(saved),
                                         builtins_by_identity(current))
    blocking = [str(problem) for problem in problems] + blocking
    if blocking:
        raise BackupError(f"{folder} was written by a run whose config differs in what changes "
                          "the training math: " + "; ".join(blocking)
                          + ". Set these back, or start a new run in another folder")
    return ResumePoint(folder, int(info["step"]), allowed, skipped)


# ---------------------------------------------------------------- finding and rotating
def rotate_backups(output_dir: Path, keep: int, newest_step: int | None = None) -> list[Path]:
    """Remove the oldest complete backups beyond `keep`; return what was removed.

    With `newest_step` (the backup just written) only backups up to that step count: a later
    one is left from before a resume (perhaps the damaged one it passed over) and must not push
    an intact earlier one out; it is replaced when the run reaches its step."""
    found = [(step, folder) for step, folder in list_backups(output_dir)
             if newest_step is None or step <= newest_step]
    removed = [folder for _, folder in found[:max(0, len(found) - keep)]]
    for folder in removed:
        shutil.rmtree(folder)
    return removed
