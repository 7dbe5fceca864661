"""What an output folder offers to resume, decided once for every front end.

A run that ended early (stopped, failed, killed, aborted) resumes from its newest backup. A run
that *finished* has nothing to resume; it may only be continued past its end, when the step
budget (`training.max_steps`) was raised above the step it finished at. A finished run writes
a backup at its last step, so the continue starts exactly where it ended; a run finished by a
Tempera from before that (or whose final backup did not fit on the disk) has only older
backups, and continuing it goes back to the newest (`rewinds`). The GUI's Resume button, the
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


def _record(output_dir: Path) -> dict:
    try:
        record = json.loads((Path(output_dir) / "run.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def finished_at(output_dir: Path) -> int | None:
    """The step the run in `output_dir` finished at, or None when it did not finish (no run,
    or it was stopped, failed or killed)."""
    record = _record(output_dir)
    if record.get("status") != "finished":
        return None
    step = record.get("step", record.get("steps_done"))
    return int(step) if isinstance(step, (int, float)) else None


def finished_before(output_dir: Path) -> int | None:
    """The step at which an earlier segment of the run in `output_dir` finished (a finished
    run continued past its end, then stopped, say), or None: run.json's `segments`."""
    segments = _record(output_dir).get("segments")
    ends = [segment.get("steps_done") for segment in segments if isinstance(segment, dict)
            and segment.get("status") == "finished"] if isinstance(segments, list) else []
    ends = [int(step) for step in ends if isinstance(step, (int, float))]
    return ends[-1] if ends else None


@dataclass(frozen=True)
class ResumeOffer:
    """What `output_dir` holds to resume, for a config whose training.max_steps is `max_steps`
    (0: the budget is set in epochs)."""
    output_dir: Path
    backup_step: int | None    # the newest complete backup
    finished_step: int | None  # where the run finished, if it did
    max_steps: int
    # where an earlier segment finished, when the run was continued past it (and then
    # stopped, failed or was killed): what a front end keeps showing of the finished run
    finished_before: int | None = None

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

    @property
    def rewinds(self) -> bool:
        """Continuing this finished run goes back before its end: its newest backup is older
        (a run finished before Tempera wrote a backup at the end): steps after the backup
        are trained again, on the raised budget's schedule, and the history after it is
        replaced."""
        return (self.finished_step is not None and self.backup_step is not None
                and self.continues_finished and self.backup_step < self.finished_step)

    @property
    def steps_to_train(self) -> int:
        """Optimizer steps a resume (or continue) trains: from the newest backup to
        `max_steps` (equal to `more_steps` for a finished run unless it `rewinds`)."""
        if self.backup_step is None or not self.can_resume or not self.max_steps:
            return 0
        return max(0, self.max_steps - self.backup_step)

    def refusal(self) -> str | None:
        """Why `--resume` is refused here (a finished run, budget not raised), else None."""
        if self.finished_step is None or self.continues_finished:
            return None
        n = self.finished_step
        budget = (f"training.max_steps is {self.max_steps}" if self.max_steps
                  else "training.max_steps is 0 (the budget is set in epochs)")
        start = (f"from its end (its backup at step {n})" if self.backup_step == n else
                 f"from its newest backup (step {self.backup_step}; it has none at its end, so "
                 f"the steps after that are trained again)" if self.backup_step else
                 "(it left no backup to continue from)")
        return (f"the run in {self.output_dir} finished at step {n}; there is nothing to resume. "
                f"To train it further, raise training.max_steps above {n} ({budget}): the "
                f"resume then continues {start} to the new maximum. To train again from the "
                f"start, choose a new output folder")

    def continue_note(self) -> str | None:
        """What a continue of a finished run does, in words (a status line when it starts),
        or None when this is no continue."""
        if not self.continues_finished or self.backup_step is None:
            return None
        if not self.rewinds:
            return (f"continuing the run that finished at step {self.finished_step} from its "
                    f"end: {self.more_steps} more steps, to step {self.max_steps}")
        return (f"continuing the run that finished at step {self.finished_step} from its "
                f"newest backup, step {self.backup_step} (it has none at its end): steps "
                f"{self.backup_step + 1} to {self.finished_step} are trained again on the "
                f"raised budget's schedule, {self.steps_to_train} steps in all")


def resume_offer(output_dir: Path, max_steps: int) -> ResumeOffer:
    found = list_backups(Path(output_dir))
    return ResumeOffer(Path(output_dir), found[-1][0] if found else None,
                       finished_at(output_dir), max_steps, finished_before(output_dir))


def finished_run_problem(output_dir: Path, resume_from: str, max_steps: int) -> Problem | None:
    """The problem a resume of a finished run is (the CLI's exit 2, the GUI's list), or None."""
    refusal = resume_offer(output_dir, max_steps).refusal()
    if refusal is None:
        return None
    return Problem("training.resume_from", "a run that ended before its step budget (or a "
                   "raised training.max_steps)", repr(resume_from), refusal)
