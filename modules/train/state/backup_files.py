"""Where backups are and which are complete: file-system only (no torch), so a front end can
list them without loading the engine. What a backup holds: modules/train/state/backup.py."""
from __future__ import annotations

import re
from pathlib import Path

BACKUPS = "backups"
INFO = "backup.json"
TENSORS = "tensors.safetensors"
NAME = re.compile(r"^step-(\d{6,})$")


class BackupError(Exception):
    """A backup cannot be read or does not fit this run."""


def backups_folder(output_dir: Path) -> Path:
    return Path(output_dir) / BACKUPS


def list_backups(output_dir: Path) -> list[tuple[int, Path]]:
    """Complete backups, oldest first. Hidden temporary folders of an interrupted write and
    folders without backup.json are never listed."""
    root = backups_folder(output_dir)
    found = []
    for folder in root.iterdir() if root.is_dir() else []:
        match = NAME.match(folder.name)
        if match and (folder / INFO).is_file() and (folder / TENSORS).is_file():
            found.append((int(match.group(1)), folder))
    return sorted(found)


def find_backup(output_dir: Path, resume_from: str) -> Path:
    """The backup `training.resume_from` names: "latest" in the output folder, or a path."""
    if resume_from == "latest":
        found = list_backups(output_dir)
        if not found:
            raise BackupError(f"no backup to resume in {backups_folder(output_dir)}")
        return found[-1][1]
    folder = Path(output_dir) / Path(resume_from).expanduser()  # an absolute path stays itself
    if not (folder / INFO).is_file():
        raise BackupError(f"{folder}: not a backup folder (it has no {INFO})")
    return folder
