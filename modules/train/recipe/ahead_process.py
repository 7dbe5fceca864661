"""The ahead process of ``compile.ahead`` (modules/train/recipe/compile_ahead.py starts it as
``python -m modules.train.recipe.ahead_process``): the run's own recipe on a copy of its config
(`ahead_config`), one training step on each batch shape the run's epoch meets
(`shape_batches`), so that its compile engine compiles them and writes the run's compile bundle.
A module of its own because it runs the recipe, which starts it.
"""
from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from modules.config import load_config
from modules.config.schema import Config
from modules.events import NullCallbacks
from modules.util.atomic import atomic_write_text


def ahead_config(config: Config, output_dir: Path) -> Config:
    """The config the ahead process runs: the run's, in a throwaway output folder, with
    nothing written but the bundle (no samples, validation, logs) and the images read
    directly (the main process caches the latents; two writers of one cache would race)."""
    ahead = copy.deepcopy(config)
    ahead.output.dir = str(output_dir)
    ahead.training.resume_from = ""
    ahead.sampling.prompts, ahead.sampling.prompts_file = [], ""
    ahead.validation.every_steps = 0
    ahead.logging.tensorboard = ahead.logging.wandb = False
    ahead.data.cache_latents = False
    ahead.compile.ahead, ahead.compile.bundle = False, ""
    return ahead


def shape_batches(batches: Any, dataset: Any) -> list[tuple[str, list]]:
    """One batch of item keys per distinct batch shape ("2x64x64": batch, height, width) in
    an epoch of the run's batches, in the order the epoch meets them."""
    from modules.data.dataset import split_key

    sizes = dataset.target_sizes
    found: dict[str, list] = {}
    for keys in batches:
        height, width = sizes[split_key(keys[0])[1]]
        found.setdefault(f"{len(keys)}x{height}x{width}", list(keys))
    return list(found.items())


def compile_ahead(config: Config, output_dir: Path) -> dict[str, Any]:
    """Train one step on each batch shape of ``config``'s run (in ``output_dir``) so that its
    compile engine compiles them and writes the run's compile bundle; what it did."""
    from modules.data.dataset import collate_examples
    from modules.events import TrainerCommands
    from modules.train.recipe.distributed import Distributed
    from modules.train.recipe.recipe import TrainingRecipe
    from modules.train.setup.prepare import prepare_run

    config = ahead_config(config, output_dir)
    callbacks = PrintedStatus()
    recipe = TrainingRecipe(prepare_run(config, callbacks), callbacks, Distributed(),
                            TrainerCommands())
    run = recipe.setup()
    try:
        shapes = shape_batches(run.batches, run.dataset)
        for shape, keys in shapes:
            callbacks.on_status(f"compiling for batch shape {shape}")
            batch = collate_examples([run.dataset[key] for key in keys])
            recipe.train_step(iter([(0, batch, True)]))
            run.guard.after_step()  # writes the bundle when this shape compiled graphs
        bundle = run.guard.bundle_record() or {}
        seconds = sum(r.get("compile_seconds") or 0.0 for r in run.guard.report().values())
        return {"shapes": [shape for shape, _ in shapes], "bundle": bundle.get("written"),
                "compile_seconds": round(seconds, 1), "write_error": bundle.get("write_error")}
    finally:
        recipe.close()


class PrintedStatus(NullCallbacks):
    """The ahead process's status lines, on its output (the main process keeps the last line
    of a failed one for its report)."""

    def on_status(self, text: str) -> None:
        print(text, flush=True)

    def on_error(self, message: str) -> None:
        print(message, flush=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Compile a run's batch shapes ahead "
                                                 "(compile.ahead); started by the run itself.")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--threads", required=True, type=int)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)  # the run's count: CPU kernels are built for it
    with tempfile.TemporaryDirectory(prefix="run-", dir=args.out.parent) as output_dir:
        result = compile_ahead(load_config(args.config), Path(output_dir))
    if result["write_error"]:
        print(f"the compile bundle was not written: {result['write_error']}", flush=True)
        return 1
    atomic_write_text(args.out, json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
