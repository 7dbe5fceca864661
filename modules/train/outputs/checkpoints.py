"""Which checkpoint a step saves, and which old checkpoints make room for it.

Checkpoints are the weights a run saves on its way (`<output>/checkpoints/<name>/`), besides
`final/`: every `output.save_every_steps` steps (`step-NNNNNN`), at the end of every
`output.save_every_epochs`th epoch (`epoch-NNNNNN`, the epoch's number counted from 1), and on
"save now" (`step-NNNNNN`). `output.keep_checkpoints` keeps the newest N of them.

Both schedules are functions of the run's position (step, epoch, batches of the epoch done),
which a backup restores exactly, so a resumed run saves exactly the checkpoints the
uninterrupted run would have, none twice and none skipped. File-system only besides `Run`.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from modules.train.state.resume_offer import saved_step

CHECKPOINTS = "checkpoints"
# Only folders named like this (and holding Tempera's step marker) are ever rotated away.
NAME = re.compile(r"^(step|epoch)-(\d{6,})$")


def checkpoints_folder(output_dir: Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def due_checkpoint(step: int, total_steps: int, epoch: int, batches_done: int,
                   batches_per_epoch: int, every_steps: int, every_epochs: int,
                   asked: bool = False) -> str | None:
    """The name of the checkpoint to save after optimizer step `step`, or None.

    `epoch` is the 0-based epoch the step trained in and `batches_done` this process's
    micro-batches of it so far: the epoch is complete when they are all done (with gradient
    accumulation the last window of an epoch may be short). Nothing is due at the run's last
    step, which final/ saves, except when asked (`asked`: the app's "save now"). A step due
    by both schedules is saved once, under its epoch name.
    """
    if step >= total_steps and not asked:
        return None
    number = epoch + 1
    if (every_epochs and batches_done >= batches_per_epoch and number % every_epochs == 0
            and step < total_steps):
        return f"epoch-{number:06d}"
    if asked or (every_steps and step % every_steps == 0):
        return f"step-{step:06d}"
    return None


def list_checkpoints(output_dir: Path) -> list[tuple[int, str, Path]]:
    """(step, name, folder) of every checkpoint the rotation may count, oldest first: a folder
    named step-N or epoch-N holding Tempera's step marker (`tempera_step.json`). A folder with
    another name, without the marker or with an unreadable one is never listed, so never
    removed."""
    root = checkpoints_folder(output_dir)
    found = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if not (folder.is_dir() and NAME.match(folder.name)):
            continue
        try:
            step = saved_step(folder)
        except ValueError:
            continue
        if step is not None:
            found.append((step, folder.name, folder))
    return sorted(found)


def rotate_checkpoints(output_dir: Path, keep: int, newest_step: int) -> list[Path]:
    """Remove the oldest checkpoints beyond `keep` (0 keeps all); return what was removed.

    Only checkpoints up to `newest_step` (the one just saved) count: a later one is left from
    a segment that ran past the backup this run resumed from; it is replaced when the run
    reaches its step again, and it must not push out the one just written.
    """
    if keep <= 0:
        return []
    found = [entry for entry in list_checkpoints(output_dir) if entry[0] <= newest_step]
    removed = [folder for _, _, folder in found[:max(0, len(found) - keep)]]
    for folder in removed:
        shutil.rmtree(folder)
    return removed
