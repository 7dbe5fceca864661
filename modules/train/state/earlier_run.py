"""What a resumed run shows of the run it continues: the loss curve up to the step it resumes
from (run.json keeps `losses`, one per step, None for a skipped step) and the newest samples in
the output folder. Read from files only, so any front end can show them before training starts."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from modules.events import ValidationScore

SAMPLE_NAME = re.compile(r"step-(\d+)-(\d+)\.png$")  # modules/train/outputs/sampling.py's names


@dataclass(frozen=True)
class LossPoint:
    step: int
    loss: float
    smoothed: float


def earlier_losses(output_dir: Path, up_to_step: int) -> list[LossPoint]:
    """The losses of steps 1..`up_to_step` from run.json, smoothed as the trainer smooths them
    (empty when there is no readable run.json)."""
    from modules.train.state.training_state import SmoothedValue
    try:
        record = json.loads((Path(output_dir) / "run.json").read_text("utf-8"))
    except (OSError, ValueError):
        return []
    losses = record.get("losses") if isinstance(record, dict) else None
    smoothing, points = SmoothedValue(), []
    for step, loss in enumerate(losses if isinstance(losses, list) else [], start=1):
        if step > up_to_step:
            break
        if isinstance(loss, (int, float)):  # None: a skipped (non-finite) step
            points.append(LossPoint(step, float(loss), smoothing.update(float(loss))))
    return points


def earlier_validation(output_dir: Path, up_to_step: int) -> list[ValidationScore]:
    """The validation passes of steps up to `up_to_step` from run.json's `validation.history`,
    each with the best step among them so far (empty when there are none)."""
    try:
        record = json.loads((Path(output_dir) / "run.json").read_text("utf-8"))
        history = record["validation"]["history"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    scores: list[ValidationScore] = []
    best: tuple[float, int] | None = None
    for step, loss in (p for p in history if isinstance(p, list) and len(p) == 2):
        if not isinstance(step, int) or step > up_to_step:
            continue
        loss = float(loss) if isinstance(loss, (int, float)) else None
        if loss is not None and (best is None or loss < best[0]):
            best = (loss, step)
        scores.append(ValidationScore(step, loss, best and best[1], best and best[0], 0))
    return scores


def latest_samples(output_dir: Path, up_to_step: int | None = None
                   ) -> tuple[int, list[tuple[int, Path]]]:
    """The newest sample step in `<output>/samples/` (at most `up_to_step`) and its images as
    (prompt index, path), by prompt; (0, []) when there is none."""
    by_step: dict[int, list[tuple[int, Path]]] = {}
    folder = Path(output_dir) / "samples"
    for path in folder.iterdir() if folder.is_dir() else []:
        match = SAMPLE_NAME.fullmatch(path.name)
        if match and (up_to_step is None or int(match[1]) <= up_to_step):
            by_step.setdefault(int(match[1]), []).append((int(match[2]), path))
    if not by_step:
        return 0, []
    step = max(by_step)
    return step, sorted(by_step[step])
