"""One seam for a run's curves and images: TensorBoard and Weights & Biases get the same series
(loss/step, loss/smoothed, lr, grad_norm, time/step_seconds, time/images_per_second,
optimizer/*, sample/N with its prompt, validation/loss) from the
same calls in train/outputs/writes.py and train/validation/validation.py.

wandb is imported only when `logging.wandb` is on: its import takes about a second and starts
nothing a run without W&B needs.
"""
from __future__ import annotations

import contextlib

import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from modules.config.outputs import WandbMode
from modules.config.schema import Config
from modules.config.secret_settings import masked_config
from modules.config.wandb_settings import OFFER_OFFLINE
from modules.util.secrets import mask_secrets, mask_tree

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

# wandb.init waits this long for the W&B server before giving up (its own default is 90 s).
WANDB_INIT_TIMEOUT_S = 60.0


class WandbStartError(RuntimeError):
    """W&B could not start the run (no network, a refused key or project): raised before the
    first training step, with what to do."""


class RunMetrics:
    """What a run logs, sent to each of its sinks: TensorBoard's writer and a W&B run, either
    of which may be absent."""

    def __init__(self, tensorboard: SummaryWriter | None = None, wandb_run: Any = None) -> None:
        self.tensorboard = tensorboard
        self.wandb_run = wandb_run

    def __bool__(self) -> bool:
        return self.tensorboard is not None or self.wandb_run is not None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_scalar(tag, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log({tag: value}, step=step)

    def add_image(self, tag: str, image: np.ndarray, step: int, caption: str = "") -> None:
        """An RGB image (height, width, 3, uint8) with its prompt: TensorBoard's image (images
        and scalars only, as before), W&B's image with the prompt as its caption, masked as
        every record is (a prompt may hold a secret-looking value, docs/cloud.md)."""
        if self.tensorboard is not None:
            self.tensorboard.add_image(tag, image, step, dataformats="HWC")
        if self.wandb_run is not None:
            import wandb
            self.wandb_run.log({tag: wandb.Image(image, caption=mask_secrets(caption))},
                               step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            import wandb
            self.wandb_run.finish()
            self.wandb_run = None
            # finish() returns once W&B's service has the run's exit record; run-<id>.wandb
            # may still lack records until the service closes the file. Twice, in full
            # test runs on a loaded machine, a resumed run's file read right after train()
            # returned held no records. teardown() waits until the service has ended with its
            # files closed; the next run starts a new one.
            wandb.teardown()


def start_wandb(config: Config, run_record: dict, run_id: str) -> Any:
    """Start (or, with the id a backup stored, continue) the run's W&B run under
    <output>/wandb/, with the config and run.json as its config. Raises WandbStartError with
    the fix when W&B refuses, before any step trains."""
    import wandb  # here, not at the top: see the module's docstring

    logging = config.logging
    output_dir = Path(config.output.dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(silent=True, console="off", save_code=False, disable_git=True,
                              init_timeout=WANDB_INIT_TIMEOUT_S)
    try:
        return wandb.init(
            project=logging.wandb_project, entity=logging.wandb_entity or None,
            name=logging.wandb_run_name or output_dir.resolve().name,
            mode="offline" if logging.wandb_mode == WandbMode.OFFLINE else "online",
            dir=str(output_dir),
            # "allow", not "must": a run first logged OFFLINE and never synced is unknown to
            # the server, and "must" would refuse to continue it there.
            id=run_id or uuid.uuid4().hex[:8], resume="allow",
            config={"tempera": masked_config(config), "run": mask_tree(run_record)},
            allow_val_change=True, settings=settings)
    except Exception as error:  # wandb raises several types (CommError, UsageError, timeouts)
        # the service process wandb.init started stays up after a failed start (a stray
        # process per attempt in a window that stays open): ended here, as close() does
        with contextlib.suppress(Exception):
            wandb.teardown()
        raise WandbStartError(
            f"Weights & Biases could not start the run in project "
            f"'{logging.wandb_project}' ({logging.wandb_mode.value}): {error}. Check the "
            f"network and the API key (WANDB_API_KEY or `wandb login`), "
            f"{OFFER_OFFLINE}") from error
