"""The settings of the short, backed-up tiny runs that the CLI tests start and stop."""
from __future__ import annotations

from pathlib import Path


def backed_up_run(cache: Path, output_dir: str, steps: int, **output) -> dict:
    """A tiny run of ``steps`` steps that backs up after every step (two kept), quiet."""
    return {
        "general": {"cache_dir": str(cache)},
        "data": {"resolution": 64},
        "training": {"max_steps": steps, "batch_size": 2, "learning_rate": 1e-3},
        "sampling": {"prompts": []},
        "logging": {"tensorboard": False},
        "output": {"dir": output_dir, "backup_every_steps": 1, "keep_backups": 2, **output},
    }
