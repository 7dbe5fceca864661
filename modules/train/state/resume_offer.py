"""What an output folder offers to resume, decided once for every front end.

A run that ended early (stopped, failed, killed) resumes from its newest backup. A run that
*finished* has nothing to resume: resuming it would re-train its last steps from an older backup
and replace its `final/` weights. It may only be continued past its end, when the step budget
(`training.max_steps`) was raised above the step it finished at. The GUI's Resume button, the
CLI's `--resume` and the engine's check before a start all ask `resume_offer`.

File-system only (no torch): the GUI calls it on every change of the output folder.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from modules.config.problems import Problem
from modules.train.state.backup_files import list_backups

# Written inside every saved weights folder (final/, checkpoints/step-N/) with the weights, in
# the same atomic swap: the step those weights hold, so a later save can tell that it is older.
SAVED_STEP_FILE = "tempera_step.json"


def saved_step(folder: Path) -> int | None:
    """The step the weights in `folder` were saved at; None when the folder has no marker
    (not saved yet, or saved by a Tempera from before the marker)."""
    try:
        return int(json.loads((Path(folder) / SAVED_STEP_FILE).read_text("utf-8"))["step"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # A marker that cannot be read must not let an older save replace the weights
        # silently: the caller reports it.
        raise ValueError(f"{Path(folder) / SAVED_STEP_FILE}: unreadable ({exc})") from exc


def finished_at(output_dir: Path) -> int | None:
    """The step the run in `output_dir` finished at, or None when it did not finish (no run,
    or it was stopped, failed or killed)."""
    try:
        record = json.loads((Path(output_dir) / "run.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("status") != "finished":
        return None
    step = record.get("step", record.get("steps_done"))
    return int(step) if isinstance(step, (int, float)) else None


@dataclass(frozen=True)
class ResumeOffer:
    """What `output_dir` holds to resume, for a config whose training.max_steps is `max_steps`
    (0: the budget is set in epochs)."""
    output_dir: Path
    backup_step: int | None    # the newest complete backup
    finished_step: int | None  # where the run finished, if it did
    max_steps: int

    @property
    def continues_finished(self) -> bool:
        """The run finished, and the raised step budget lets it train on."""
        return self.finished_step is not None and self.max_steps > self.finished_step

    @property
    def can_resume(self) -> bool:
        return self.backup_step is not None and (self.finished_step is None
                                                 or self.continues_finished)

    @property
    def more_steps(self) -> int:
        """Steps a continued finished run adds beyond where it finished."""
        if self.finished_step is None or not self.continues_finished:
            return 0
        return self.max_steps - self.finished_step

    def refusal(self) -> str | None:
        """Why `--resume` is refused here (a finished run, budget not raised), else None."""
        if self.finished_step is None or self.continues_finished:
            return None
        n = self.finished_step
        budget = (f"training.max_steps is {self.max_steps}" if self.max_steps
                  else "training.max_steps is 0 (the budget is set in epochs)")
        return (f"the run in {self.output_dir} finished at step {n}; there is nothing to resume "
                f"and resuming would re-train its last steps over its final weights. To train "
                f"it further, raise training.max_steps above {n} ({budget}): the resume then "
                f"continues from the newest backup to the new maximum. To train again from the "
                f"start, choose a new output folder")


def resume_offer(output_dir: Path, max_steps: int) -> ResumeOffer:
    found = list_backups(Path(output_dir))
    return ResumeOffer(Path(output_dir), found[-1][0] if found else None,
                       finished_at(output_dir), max_steps)


def finished_run_problem(output_dir: Path, resume_from: str, max_steps: int) -> Problem | None:
    """The problem a resume of a finished run is (the CLI's exit 2, the GUI's list), or None."""
    refusal = resume_offer(output_dir, max_steps).refusal()
    if refusal is None:
        return None
    return Problem("training.resume_from", "a run that ended before its step budget (or a "
                   "raised training.max_steps)", repr(resume_from), refusal)
