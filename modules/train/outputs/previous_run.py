"""What a fresh start in an output folder would remove of the run already there.

With `output.overwrite` a new run (not a resume) removes the earlier run's samples, logs,
backups, best/ and checkpoints before its first step (`clear_previous_run` in
modules/train/setup/start.py removes what `RUN_OUTPUTS` names), and its first save replaces
final/. A front end asks `previous_run` before such a start so it can say so first (the GUI's
Start asks; the CLI prints it), and `free_sibling` names a folder to start in instead.

File-system only (no torch): the GUI calls it before the engine is loaded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from modules.train.outputs.checkpoints import list_checkpoints
from modules.train.state.backup_files import list_backups
from modules.train.state.resume_offer import saved_step

BEST = "best"  # the best validation step's weights (modules/train/outputs/best_weights.py)
# An earlier run's outputs that would mix with a new run's, removed by a fresh start with
# output.overwrite. final/ is not among them: the new run replaces it atomically with its own,
# so a new run that fails early does not cost the user the previous run's result.
# Its checkpoints and best/ the new run would not replace (other steps, or no validation):
# they would sit beside the new run's, counted by output.keep_checkpoints.
RUN_OUTPUTS = ("samples", "tensorboard", "wandb", "backups", BEST)
# The folders besides backups and samples, as a sentence names them
_LOGS = {"tensorboard": "TensorBoard logs (tensorboard/)", "wandb": "W&B files (wandb/)",
         BEST: "the best weights (best/)"}


@dataclass(frozen=True)
class PreviousRun:
    """An output folder's earlier run, as far as a fresh start would remove or replace it."""
    output_dir: Path
    status: str                  # run.json's status (finished, stopped, failed, running); ""
    step: int | None             # the step run.json says it got to
    final: bool                  # final/ holds weights
    final_step: int | None       # their step (None: no step marker, or an unreadable one)
    backups: tuple[int, ...]     # the complete backups' steps
    samples: int                 # files in samples/
    checkpoints: tuple[str, ...]  # the checkpoint folders the rotation counts
    logs: tuple[str, ...]        # tensorboard, wandb, best: those present

    @property
    def anything(self) -> bool:
        """A fresh start would remove or replace something of it."""
        return bool(self.final or self.backups or self.samples or self.checkpoints or self.logs)

    def removed(self) -> list[str]:
        """What a fresh start removes (at once) or replaces (final/, at its first save), in
        words: "final/ (the weights of step 16)", "3 backups (steps 5, 10, 16)", ..."""
        words = []
        if self.final:
            of = f"the weights of step {self.final_step}" if self.final_step else "its weights"
            words.append(f"final/ ({of}; replaced when the new run first saves)")
        if self.backups:
            steps = ", ".join(str(step) for step in self.backups)
            words.append(f"{_count(len(self.backups), 'backup')} (step {steps})")
        if self.samples:
            words.append(f"{_count(self.samples, 'sample')} (samples/)")
        if self.checkpoints:
            words.append(f"{_count(len(self.checkpoints), 'checkpoint')} ("
                         + ", ".join(self.checkpoints) + ")")
        words += [_LOGS[name] for name in self.logs]
        return words

    def describe(self) -> str:
        """How the run there ended and what a fresh start removes, as one paragraph."""
        how = {"finished": "finished", "stopped": "was stopped", "failed": "failed",
               "running": "was killed or crashed", "interrupted": "was interrupted"}
        ended = how.get(self.status)
        at = f" at step {self.step}" if self.step is not None and ended else ""
        lead = (f"The run in {self.output_dir} {ended}{at}." if ended
                else f"{self.output_dir} holds an earlier run's files.")
        return f"{lead} Starting anew there removes: " + "; ".join(self.removed()) + "."


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _record(output_dir: Path) -> dict:
    try:
        record = json.loads((output_dir / "run.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def previous_run(output_dir: Path) -> PreviousRun | None:
    """What a fresh start in `output_dir` would remove or replace, read from the disk now;
    None when it would remove nothing (no folder, an empty one, a run that saved nothing)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    record = _record(output_dir)
    step = record.get("step", record.get("steps_done"))
    final = output_dir / "final"
    has_final = final.is_dir() and any(final.iterdir())
    try:
        final_step = saved_step(final) if has_final else None
    except ValueError:  # an unreadable marker: the weights are there all the same
        final_step = None
    samples = output_dir / "samples"
    found = PreviousRun(
        output_dir, str(record.get("status", "")),
        int(step) if isinstance(step, (int, float)) else None, has_final, final_step,
        tuple(step for step, _ in list_backups(output_dir)),
        sum(1 for path in samples.iterdir() if path.is_file()) if samples.is_dir() else 0,
        tuple(name for _, name, _ in list_checkpoints(output_dir)),
        tuple(name for name in ("tensorboard", "wandb", BEST) if (output_dir / name).is_dir()))
    return found if found.anything else None


def free_sibling(output_dir: Path) -> Path:
    """A folder beside `output_dir` to start in instead: `<name>-2`, `<name>-3`, ... the first
    that does not exist yet (or is empty)."""
    output_dir = Path(output_dir)
    stem = output_dir.name
    base = stem.rsplit("-", 1)[0] if stem.rsplit("-", 1)[-1].isdigit() and "-" in stem else stem
    number = 2
    while True:
        candidate = output_dir.with_name(f"{base}-{number}")
        if not candidate.exists() or (candidate.is_dir() and not any(candidate.iterdir())):
            return candidate
        number += 1
