"""What stochastic rounding buys for bfloat16 weights (docs/memory.md, "Fused backward"),
measured on the tiny model: the same full fine-tune three times, same seed and data, at a
learning rate small enough that many AdamW updates are below bfloat16's spacing:

- `float32`: float32 trained weights, the plain optimizer step (the reference);
- `bf16_nearest`: bfloat16 trained weights, torch's AdamW (each update rounded to nearest);
- `bf16_stochastic`: bfloat16 trained weights, `training.fused_backward` (torchao's AdamW with
  `bf16_stochastic_round=True`, stepped in backward).

For each run: the mean loss, and its change to the denoiser's weights (from the base at the
run's trained dtype) against the reference's change: `update_kept` (the norm of its change
over the reference's), `update_error` (the distance between the two changes over the
reference's) and `update_cosine` (their cosine).

`scripts/measure_stochastic_rounding.py` is the command line.
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file

from modules.config.overrides import apply_overrides
from modules.config.schema import Config
from modules.events import RecordingCallbacks
from modules.model_types import BUILTIN_DEMO
from modules.models.tiny import ensure_builtin_model

TINY = BUILTIN_DEMO
UNET_FILE = Path("unet") / "diffusion_pytorch_model.safetensors"
RUNS = {
    "float32": ("model.train_dtype=FLOAT32",),
    "bf16_nearest": ("model.train_dtype=BFLOAT16",),
    "bf16_stochastic": ("model.train_dtype=BFLOAT16", "training.fused_backward=true"),
}


def run_config(cache: Path, out: Path, steps: int, lr: float, *overrides: str) -> Config:
    """The tiny model's full fine-tune the comparison trains (64 px, batch 2, no samples)."""
    return apply_overrides(Config(), [
        f"general.cache_dir={cache}", f"output.dir={out}", f"model.path={TINY}",
        "training.method=FINE_TUNE", "data.resolution=64", f"training.max_steps={steps}",
        "training.batch_size=2", f"training.learning_rate={lr}", "training.max_grad_norm=0",
        "sampling.prompts=[]", "logging.tensorboard=false", *overrides])


def l2(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm of several tensors taken together."""
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


def measure(cache: Path, work: Path, steps: int, lr: float) -> dict:
    from modules.train.trainer import train

    base = load_file(str(ensure_builtin_model(TINY, cache) / UNET_FILE))
    finals, losses = {}, {}
    for name, overrides in RUNS.items():
        out = work / name
        train(run_config(cache, out, steps, lr, *overrides), RecordingCallbacks())
        record = json.loads((out / "run.json").read_text())
        losses[name] = statistics.fmean(x for x in record["losses"] if x is not None)
        finals[name] = load_file(str(out / "final" / UNET_FILE))
    reference = {k: finals["float32"][k].float() - base[k].float() for k in base}
    ref_norm = l2(reference.values())
    report: dict = {"steps": steps, "learning_rate": lr, "runs": {}}
    for name, weights in finals.items():
        # each run's change from where it started: the base at its trained dtype
        change = {k: weights[k].float() - base[k].to(weights[k].dtype).float() for k in base}
        dot = sum(float((change[k].double() * reference[k].double()).sum()) for k in base)
        norm = l2(change.values())
        report["runs"][name] = {
            "mean_loss": round(losses[name], 5),
            "update_kept": round(norm / ref_norm, 4),
            "update_error": round(l2(change[k] - reference[k] for k in base) / ref_norm, 4),
            "update_cosine": round(dot / (norm * ref_norm), 4) if norm else 0.0}
    return report
