"""The training run's public entry: prepare (validate, load; nothing written), then the recipe
(train/recipe/recipe.py: setup → train → close), with one failure handling for every front end."""
from __future__ import annotations

from pathlib import Path

from modules.config.problems import ConfigError
from modules.config.schema import Config
from modules.events import NullCallbacks, StopRequested, TrainerCallbacks, TrainerCommands
from modules.train.recipe.distributed import Distributed, init_distributed
from modules.train.state.backup import random_states, set_random_states
from modules.train.state.history import record_compile_time
from modules.train.setup.prepare import PreparedRun, prepare_run
from modules.train.recipe.loop import NonFiniteTraining
from modules.train.recipe.fused import FusedBackward
from modules.train.recipe.recipe import RunResult, TrainingRecipe
from modules.train.outputs.metrics import WandbStartError
from modules.train.outputs.record import peak_memory
from modules.train.setup.start import resume_hint
from modules.util.disk import DiskFull
from modules.util.errors import describe, is_out_of_memory

__all__ = ["NonFiniteTraining", "RunResult", "TrainingAborted", "TrainingError", "train"]

OUT_OF_MEMORY_ADVICE = ("lower training.batch_size or data.resolution, turn on "
                        "training.gradient_checkpointing, train LORA instead of FINE_TUNE, or "
                        "use less precision (training.mixed_precision, model.weight_dtype)")


class TrainingError(Exception):
    """Training failed after it started; files saved before the failure are intact."""


class TrainingAborted(Exception):
    """The run was interrupted at once (KeyboardInterrupt: the CLI's second stop signal)
    after its output folder was written; run.json says `aborted` with the steps done."""


def train(config: Config, callbacks: TrainerCallbacks | None = None,
          commands: TrainerCommands | None = None) -> RunResult:
    """Validate, prepare and run one training; raise ConfigError before anything is written.

    The global random generators (Python's, NumPy's, torch's CPU one, and CUDA's where CUDA
    was in use before the run) are left as the caller had them, however the run ends:
    loading the model draws from torch's, setup seeds it (LoRA's init), steps may reseed it
    (adapter dropout) and a resume sets all of them from the backup, and a front end that
    trains again in this process (the GUI) must not inherit that. The run's own states are
    in its backups, taken at step boundaries, so exact resume does not depend on them."""
    states = random_states()
    dist = init_distributed(config.general.device, config.training.distributed_strategy)
    try:
        result = run_training(config, callbacks, commands, dist)
        # every rank has made its last collective and rank 0 its last write before any of
        # them leaves the group (Distributed.close)
        dist.barrier()
        return result
    finally:
        dist.close()
        set_random_states(states)


def run_training(config: Config, callbacks: TrainerCallbacks | None,
                 commands: TrainerCommands | None, dist: Distributed) -> RunResult:
    """`train`'s body: prepare, set up, train, close, with one failure handling."""
    commands = commands or TrainerCommands()
    if not dist.is_main:  # one rank reports; the others train quietly
        callbacks = None
    callbacks = callbacks or NullCallbacks()
    with dist.main_first():  # rank 0 builds cached built-ins before the others look for them
        prepared: PreparedRun = prepare_run(config, callbacks)  # may raise ConfigError
    dist.barrier()  # every rank validated before rank 0 writes the first file
    recipe = TrainingRecipe(prepared, callbacks, dist, commands)
    try:
        run = recipe.setup()
    except StopRequested as stop:  # before the first step: nothing to back up or save
        steps = prepared.resume.step if prepared.resume else 0
        callbacks.on_status(f"stopped before training began ({stop}); nothing was trained, "
                            "so no backup or weights were written")
        return RunResult("stopped", steps, Path(config.output.dir), {"status": "stopped"})
    except KeyboardInterrupt as exc:
        raise aborted(recipe, "while the run was being set up") from exc
    except WandbStartError as exc:  # before the first step: the message says what to change
        callbacks.on_error(str(exc))
        raise TrainingError(str(exc)) from exc
    try:
        result = recipe.train()
        if dist.is_main:  # what a front end shows as the expected compile time next time
            record_compile_time(config, run.device.type, result.record.get("compile", {}))
        return result
    except KeyboardInterrupt as exc:
        raise aborted(recipe, "while training") from exc
    except ConfigError:
        raise
    except Exception as exc:
        message = failure_message(exc, run.step) + backup_after_failure(recipe, exc)
        try:
            run.record.write(status="failed", error=message,
                             memory=peak_memory(run.device.type == "cuda"))
        except OSError as record_exc:  # a full disk: the message still reaches the user
            message += f"; run.json could not be updated ({describe(record_exc)})"
        callbacks.on_error(message)
        raise TrainingError(message) from exc
    finally:
        recipe.close()


def aborted(recipe: TrainingRecipe, when: str) -> TrainingAborted:
    """An abort (a second stop signal: no backup, no save) after the output folder was
    written: run.json says `aborted` with the steps done, where the record was started, and
    the message says what can be resumed."""
    record = recipe.record
    step = recipe.run.step if recipe.run is not None else record.steps_before if record else 0
    message = (f"aborted at step {step} {when}, at once (a second stop signal): no backup or "
               f"weights were written by the abort"
               + (resume_hint(Path(recipe.prepared.config.output.dir)) if record else ""))
    if record is not None and recipe.dist.is_main:
        try:
            record.write(status="aborted", step=step, aborted=message)
        except OSError as exc:  # a full disk: the message still reaches the user
            message += f"; run.json could not be updated ({describe(exc)})"
    recipe.callbacks.on_error(message)
    return TrainingAborted(message)


def failure_message(exc: Exception, step: int) -> str:
    """One line for a failed run; out of memory and a full disk say what to change."""
    if is_out_of_memory(exc):
        return f"out of memory at step {step} ({describe(exc)}): {OUT_OF_MEMORY_ADVICE}"
    if isinstance(exc, (NonFiniteTraining, DiskFull)):
        return f"training stopped at step {step}: {exc}"
    return f"training failed at step {step}: {describe(exc)}"


def backup_after_failure(recipe: TrainingRecipe, exc: Exception) -> str:
    """Write a backup of the last good step after a failure, when one can help: not after
    non-finite steps (the last backup from before them is the one to go back to) nor when
    the disk is full. Returns what to add to the failure message."""
    run = recipe.built_run
    if isinstance(exc, (NonFiniteTraining, DiskFull)) or run.step == 0:
        return resume_hint(run.output_dir)
    if isinstance(run.optimizer, FusedBackward) and (half := run.optimizer.unfinished_step()):
        run.record.write(backup_after_failure=f"not written: {half}, so the weights were part "
                                              "way through a step")
        return (f"; no backup after the failure ({half} when it failed: a backup would hold "
                "half a step)" + resume_hint(run.output_dir))
    if run.dist.sharded:  # gathering needs every process, and the failed one may not come
        if run.dist.is_main:
            run.record.write(backup_after_failure="not written: under FSDP a backup gathers "
                                                  "every process's shards, and a failure may "
                                                  "have ended some of them")
        return ("; no backup after the failure (FSDP: gathering the sharded state needs every "
                "process)" + resume_hint(run.output_dir))
    try:  # not agreed: the other processes may not come to it
        recipe.save_backup("after a failure", agreed=False)
    except Exception as backup_exc:  # noqa: BLE001 - reported in the failure message
        return (f"; the backup after the failure failed too ({describe(backup_exc)})"
                + resume_hint(run.output_dir))
    return resume_hint(run.output_dir)
