"""The training loop's small helpers around the step (train/recipe/recipe.py runs them): the
micro-batches of an accumulation window, what a step reports, skipped non-finite steps, how
long steps waited for data, and when a backup is due."""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from modules.config.schema import MixedPrecision
from modules.events import Progress, TrainerCommands
from modules.train.state.backup import BoundaryState
from modules.train.recipe.eta import (estimated_sample_seconds, estimated_validation_seconds,
                                      eta_seconds, samples_still_due, validations_still_due)
from modules.train.state.run import Run

MicroBatch = tuple[int, dict, bool]  # (index in the epoch, batch, closes the window)


class NonFiniteTraining(Exception):
    """Too many optimizer steps in a row had a NaN/inf loss or gradients (all were skipped)."""


def batches(run: Run, commands: TrainerCommands) -> Iterator[MicroBatch]:
    """(index in epoch, batch, closes_accumulation_window) until the step budget is used or Stop.

    Starts where `run.state` says (a resumed run skips the batches it already trained). Stop
    is looked at when a window starts, so a stopped run never leaves half a window's gradients
    behind.
    """
    accumulation = run.config.training.gradient_accumulation
    state = run.state
    while state.epoch < run.budget.epochs:
        loader = run.loader_for_epoch(state.epoch, skip_batches=state.batches_done)
        in_epoch = state.batches_done + len(loader)
        for i, batch in enumerate(run.feed.timed(loader), start=state.batches_done):
            if i % accumulation == 0 and run.stop_requested(commands):
                return
            closes = (i + 1) % accumulation == 0 or i + 1 == in_epoch
            yield i, batch, closes
            if closes and run.step >= run.budget.total_steps:
                return
        state.epoch += 1
        state.batches_done = 0


def feeding(run: Run) -> None:
    """How long the steps waited for their batches, in run.json, and a hint in the status
    when it was long enough to matter (the first step, compile included, is left out)."""
    seconds = sum(run.record.step_seconds[1:])
    workers, cached = run.config.data.workers, run.config.data.cache_latents
    run.record.write(data_loading=run.feed.report(seconds, workers,
                                                  pin_memory=run.device.type == "cuda"))
    hint = run.feed.hint(seconds, workers, cached)
    if hint:
        run.callbacks.on_status(hint)


def skip_non_finite_step(run: Run, loss: float) -> None:
    """Count a skipped step; too many in a row stop the run (no weight was changed by them)."""
    state, t = run.state, run.config.training
    state.bad_steps += 1
    state.skipped_steps += 1
    run.record.losses.append(None)
    run.callbacks.on_status(f"step {run.step}: loss {loss} or its gradients are not finite; "
                            f"the step was skipped ({state.bad_steps} in a row)")
    if state.bad_steps < t.max_bad_steps:
        return
    cause = ("fp16 overflow: use BF16 mixed precision, or a lower learning rate"
             if t.mixed_precision == MixedPrecision.FP16 or
             t.mixed_precision == MixedPrecision.NO and run.compute_dtype == torch.float16
             else f"the learning rate ({t.learning_rate:g}) is probably too high")
    raise NonFiniteTraining(f"{state.bad_steps} steps in a row (up to step {run.step}) had a "
                            f"non-finite loss or gradients ({cause}); no weights were changed "
                            "by them and nothing non-finite was saved")


def progress_event(run: Run, loss: float, smoothed_loss: float,
                   sample_seconds: float | None = None) -> Progress:
    """Progress after a step; the ETA counts the sampling and validation passes still to
    come, each at its last pass's measured duration (`sample_seconds`, the validator's
    `last_seconds`) or an estimate before the first."""
    times = run.record.step_seconds[1:] or run.record.step_seconds
    per_step = sorted(times)[len(times) // 2]
    config, total = run.config, run.budget.total_steps
    due = samples_still_due(run.step, total, config.sampling.every_steps, len(run.prompts))
    per_sample = (sample_seconds if sample_seconds is not None
                  else estimated_sample_seconds(config, run.prompts, per_step))
    validations, per_validation = validation_eta_terms(run, per_step)
    eta, sampling, validating = eta_seconds(total - run.step, per_step, due, per_sample,
                                            validations, per_validation)
    return Progress(step=run.step, max_steps=total, epoch=run.state.epoch + 1,
                    max_epochs=run.budget.epochs, loss=loss, smoothed_loss=smoothed_loss,
                    lr=run.current_lr(), seconds_per_step=per_step,
                    eta_seconds=eta, sampling_eta_seconds=sampling,
                    validation_eta_seconds=validating)


def validation_eta_terms(run: Run, per_step: float) -> tuple[int, float]:
    """(validation passes still to come, seconds per pass) for the ETA; (0, 0) when
    validation is off."""
    validator = run.validator
    if validator is None:
        return 0, 0.0
    due = validations_still_due(run.step, run.budget.total_steps,
                                run.config.validation.every_steps)
    seconds = (validator.last_seconds if validator.last_seconds is not None
               else estimated_validation_seconds(run.config, validator.count, per_step))
    return due, seconds


def mark_boundary(run: Run) -> None:
    """Remember the small states as they are now, between two optimizer steps (what a backup
    written later, even after a failure mid-window, saves)."""
    run.boundary = BoundaryState.capture(run.state.state_dict())


def mark_end(run: Run) -> None:
    """The boundary of a finished run's last step, with what the end-of-run sample and
    validation added to the training state (the history, the last sample's step); the random
    states stay the step's, as the loop marked them."""
    marked = run.boundary if run.boundary is not None else BoundaryState.capture({})
    run.boundary = BoundaryState(run.state.state_dict(), marked.random)


def backup_due(run: Run) -> bool:
    """A scheduled backup is due (by steps or minutes), not at the last step and not while
    steps are being skipped as non-finite (the backups from before that are the ones to keep).

    Several processes must agree (each takes part in the backup: under FSDP in gathering it,
    under DDP too in agreeing on how rank 0's write went): the step count, the budget and the
    skipped steps are the same on every rank, the clocks are not, so the minutes are agreed on
    with one small collective per step (the step's gradient exchange already is one); any
    rank's elapsed interval makes it due."""
    out = run.config.output
    by_steps = out.backup_every_steps and run.step % out.backup_every_steps == 0
    by_time = bool(out.backup_every_minutes
                   and time.monotonic() - run.last_backup_time >= 60 * out.backup_every_minutes)
    if run.dist.enabled and out.backup_every_minutes:
        by_time = run.dist.any(by_time)
    return (bool(by_steps or by_time) and run.step < run.budget.total_steps
            and run.state.bad_steps == 0)


def refuse_backup(run: Run, step: int, reason: str, why: str) -> None:
    """A backup holding NaN or inf is never written (resuming it would only fail again): say
    so, keep the previous one, and list the refusal in run.json."""
    kept = (f"the backup of step {run.last_backup_step} is kept"
            if run.last_backup_step > 0 else "there is no earlier backup")
    run.callbacks.on_status(f"backup refused: {why}; {kept}")
    refused = [*run.record.data.get("backups_refused", []),
               {"step": step, "reason": reason, "why": why}]
    run.record.write(backups_refused=refused)
    run.refused_backup_step = step
    run.last_backup_time = time.monotonic()  # try again one interval later, not every step
