"""What changes while a run trains, apart from the weights and the optimizer: its position in the
data, the generator every step's noise is drawn from, and the displayed loss's smoothing.

`Run` (train/state/run.py) holds one `TrainingState` beside its model parts, optimizer, LR schedule,
GradScaler and EMA; a backup (train/state/backup.py) saves and restores exactly these.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modules.data.seeds import derive_seed


class SmoothedValue:
    """Exponential moving average for the displayed loss."""

    def __init__(self, beta: float = 0.9) -> None:
        self.beta, self.value, self.count = beta, 0.0, 0

    def update(self, x: float) -> float:
        self.count += 1
        self.value = self.beta * self.value + (1 - self.beta) * x
        return self.current()

    def current(self) -> float:
        """The bias-corrected average (0 before the first value)."""
        return self.value / (1 - self.beta ** self.count) if self.count else 0.0

    def state_dict(self) -> dict:
        return {"beta": self.beta, "value": self.value, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.beta, self.value, self.count = (float(state["beta"]), float(state["value"]),
                                             int(state["count"]))


def draws_generator(seed: int, rank: int) -> torch.Generator:
    """The generator a rank draws each step's noise from (reseeded at every step)."""
    return torch.Generator("cpu").manual_seed(derive_seed("draws", seed, rank, 0))


@dataclass
class TrainingState:
    """A run's position in the data and the counters and smoothing that go with it.

    `batches_done` counts this rank's micro-batches of `epoch` already trained: the data order is
    a pure function of (seed, epoch), so a resumed run skips exactly these and sees the same
    batches next. It is only ever saved at a window boundary (after an optimizer step).
    """
    generator: torch.Generator
    step: int = 0
    epoch: int = 0
    batches_done: int = 0
    last_sample_step: int = -1
    bad_steps: int = 0        # non-finite optimizer steps in a row (skipped)
    skipped_steps: int = 0    # non-finite optimizer steps in all
    smoothed: SmoothedValue = field(default_factory=SmoothedValue)
    # [step, validation loss (None: not finite)] per validation pass (train/validation/validation.py)
    validation: list[list] = field(default_factory=list)
    # The W&B run this run logs to (train/outputs/metrics.py): a resumed run continues it.
    wandb_run_id: str = ""
    # The passes ("sample", "validation") due at `step` that Stop skipped or cut short: a
    # resumed run runs them before its first step (docs/resume.md, "Sampling and validation
    # at the stopped step"), so the series keep every point they were asked for.
    owed_passes: list[str] = field(default_factory=list)

    def reseed_draws(self, seed: int, rank: int) -> None:
        """Seed the draws of the step about to run from (seed, rank, step): every process of a
        multi-GPU run draws its own noise, and a resumed process draws exactly what it would
        have drawn, without any other process's generator state."""
        self.generator.manual_seed(derive_seed("draws", seed, rank, self.step))

    def state_dict(self) -> dict:
        """Plain JSON values. The generator is not in it: `reseed_draws` derives its state from
        (seed, rank, step) at every step."""
        return {"step": self.step, "epoch": self.epoch, "batches_done": self.batches_done,
                "last_sample_step": self.last_sample_step, "bad_steps": self.bad_steps,
                "skipped_steps": self.skipped_steps, "smoothed": self.smoothed.state_dict(),
                "validation": [list(point) for point in self.validation],
                "wandb_run_id": self.wandb_run_id, "owed_passes": list(self.owed_passes)}

    def load_state_dict(self, state: dict) -> None:
        for name in ("step", "epoch", "batches_done", "last_sample_step", "bad_steps",
                     "skipped_steps"):
            setattr(self, name, int(state[name]))
        self.smoothed.load_state_dict(state["smoothed"])
        # backups written before validation existed hold no history
        self.validation = [[int(step), loss] for step, loss in state.get("validation", [])]
        self.wandb_run_id = str(state.get("wandb_run_id", ""))  # none before W&B existed
        self.owed_passes = [str(name) for name in state.get("owed_passes", [])]  # none before
