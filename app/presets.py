"""Preset files: listing the built-in ones and the user's own, and saving without clobbering.

Built-in presets live in the repository's `training_presets/` (recursive; the sub-folder is the
group). The GUI saves what `scripts/train.py --config` loads: `save_config` with sparse keys and
paths relative to the preset's folder.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from modules.config import Config, relativize_paths, save_config

BUILTIN_PRESETS_DIR = Path(__file__).resolve().parent.parent / "training_presets"


@dataclass(frozen=True)
class PresetEntry:
    label: str       # what the picker shows, e.g. "sd15 / lora_512" or "mine / cats"
    path: Path
    builtin: bool
    group: str       # the sub-folder ("" for top level) or "mine"


class BuiltinPresetError(Exception):
    """Refused: the target is a built-in preset (it ships with Tempera and is not overwritten)."""


def list_presets(builtin_dir: Path, user_dir: Path) -> list[PresetEntry]:
    """Built-in presets grouped by folder (top level first), then the user's presets."""
    entries: list[PresetEntry] = []
    if builtin_dir.is_dir():
        for path in sorted(builtin_dir.rglob("*.json"), key=lambda p: (len(p.parts), str(p))):
            rel = path.relative_to(builtin_dir)
            group = "/".join(rel.parts[:-1])
            label = f"{group} / {path.stem}" if group else path.stem
            entries.append(PresetEntry(label, path, True, group))
    if user_dir.is_dir():
        for path in sorted(user_dir.rglob("*.json")):
            rel = path.relative_to(user_dir).with_suffix("")
            entries.append(PresetEntry(f"mine / {rel.as_posix()}", path, False, "mine"))
    return entries


def is_builtin(path: Path, builtin_dir: Path) -> bool:
    return Path(path).resolve().is_relative_to(Path(builtin_dir).resolve())


def save_preset(config: Config, target: Path, builtin_dir: Path,
                allow_new_builtin: bool = False) -> Path:
    """Write `config` as a sparse preset at `target`, paths relative to its folder.

    Overwriting an existing built-in preset is always refused; creating a new file among the
    built-ins needs `allow_new_builtin` (the GUI asks first).
    """
    target = Path(target)
    if target.suffix != ".json":
        target = target.with_suffix(".json")
    if is_builtin(target, builtin_dir):
        if target.exists():
            raise BuiltinPresetError(f"{target} is a built-in preset; save under another name")
        if not allow_new_builtin:
            raise BuiltinPresetError(f"{target} is inside the built-in presets folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    save_config(relativize_paths(config, target.parent.resolve()), target, sparse=True)
    return target
