"""The weights of the best validation pass, kept in `<output>/best/` (`validation.save_best`).

After a validation pass (train/validation/validation.py) whose loss is lower than every earlier pass's in
the run's history, the weights it scored (the averaged ones with EMA or schedule-free AdamW,
as a checkpoint holds) are saved into best/ through the checkpoints' own save path, in every
`output.formats`. That path writes a temporary folder and swaps it in only when complete, so
an interrupted save leaves the previous best/ as it was.

The history is the source of truth: it is part of the training state every backup holds, so a
resumed run knows the best loss so far, and a pass after the resume that scores worse does not
replace best/. best/ sits beside checkpoints/, outside the folders `output.keep_checkpoints`
rotates. run.json's `best_weights` says which step and loss best/ holds.
"""
from __future__ import annotations

from pathlib import Path

# the folder's name lives with what a fresh start removes, which the GUI reads without torch
from modules.train.outputs.previous_run import BEST
from modules.train.outputs.writes import save_weights_into
from modules.train.state.run import Run


def best_folder(output_dir: Path) -> Path:
    return Path(output_dir) / BEST


def latest_pass_improves(history: list[list]) -> bool:
    """The latest pass scored a finite loss lower than every earlier finite one (an equal loss
    leaves the earlier step the best, as run.json's `best` does)."""
    if not history or history[-1][1] is None:
        return False
    earlier = [loss for _, loss in history[:-1] if loss is not None]
    return not earlier or history[-1][1] < min(earlier)


def keep_if_best(run: Run) -> bool:
    """Save best/ when the pass just made (the last of the history) is the best so far and
    `validation.save_best` is on (the main process writes; every rank calls it: under FSDP
    the sharded weights are gathered by all, and the outcome of rank 0's write is agreed by
    all). Returns whether best/ was written."""
    if not (run.config.validation.save_best and latest_pass_improves(run.state.validation)):
        return False
    step, loss = run.state.validation[-1]
    save_weights_into(run, best_folder(run.output_dir))
    if not run.dist.is_main:
        return False
    run.record.write(best_weights={"folder": BEST, "step": step, "loss": loss})
    run.callbacks.on_status(f"best/ now holds the weights of step {step} "
                            f"(validation loss {loss:.5f})")
    return True
