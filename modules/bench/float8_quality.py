"""What 8-bit weight storage costs in quality (docs/memory.md), measured, not assumed: the same
LoRA trained on the tiny model twice, on the base at `model.weight_dtype` and on the base stored
in 8 bits (`model.weight_storage=FLOAT8`, `INT8` or `W8A8`), same seed and data; then each saved LoRA
applied to the unquantized base, and its effect on the denoiser's prediction compared.

`scripts/measure_float8_quality.py` is the command line; tests/train/test_weight_storage.py runs
the same comparison on a few steps.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from modules.config.overrides import apply_overrides
from modules.config.schema import Config, DType
from modules.events import RecordingCallbacks
from modules.model_types import BUILTIN_DEMO
from modules.models.bundle import TORCH_DTYPES
from modules.models.tiny import ensure_builtin_model

LORA_FILE = "pytorch_lora_weights.safetensors"
TINY = BUILTIN_DEMO


def quality_config(cache: Path, out: Path, steps: int, weight_dtype: str,
                   *overrides: str) -> Config:
    """The tiny model's LoRA run the comparison trains (64 px, batch 2, no samples)."""
    return apply_overrides(Config(), [
        f"general.cache_dir={cache}", f"output.dir={out}", f"model.path={TINY}",
        f"model.weight_dtype={weight_dtype}", f"training.max_steps={steps}",
        "training.batch_size=2", "training.learning_rate=1e-3", "data.resolution=64",
        "sampling.prompts=[]", "logging.tensorboard=false", *overrides])


def lora_effect_gap(cache: Path, weight_dtype: torch.dtype, reference: Path,
                    other: Path) -> dict[str, float]:
    """Both runs' saved LoRAs (final/) applied to the unquantized base, on one fixed input:
    how far the second's effect on the prediction is from the first's, relative to the first's
    size (0 is the same LoRA), and the size of the first's effect."""
    from diffusers import UNet2DConditionModel

    folder = ensure_builtin_model(TINY, cache)
    generator = torch.Generator().manual_seed(0)
    config = UNet2DConditionModel.load_config(folder, subfolder="unet")
    latents = torch.randn(2, config["in_channels"], 8, 8, generator=generator).to(weight_dtype)
    context = torch.randn(2, 4, config["cross_attention_dim"],
                          generator=generator).to(weight_dtype)

    def predict(lora: Path | None) -> torch.Tensor:
        model = UNet2DConditionModel.from_pretrained(folder, subfolder="unet",
                                                     torch_dtype=weight_dtype)
        if lora is not None:
            model.load_lora_adapter(str(lora / "final"), prefix="unet", weight_name=LORA_FILE)
        with torch.no_grad():
            return model(latents, torch.tensor([250, 750]), context).sample.float()

    base = predict(None)
    want, got = predict(reference) - base, predict(other) - base
    return {"relative_gap": float((got - want).norm() / want.norm()),
            "effect_rms": float(want.pow(2).mean().sqrt())}


def measure(cache: Path, work: Path, steps: int, weight_dtype: str = "BFLOAT16",
            storage: str = "FLOAT8") -> dict:
    """Train both LoRAs for `steps` steps and compare their loss curves and saved effects
    (the stored run is keyed "float8" for either storage, as earlier results are)."""
    from modules.train.trainer import train

    runs = {"base": (), "float8": (f"model.weight_storage={storage}",)}
    losses = {}
    for name, extra in runs.items():
        out = work / name
        train(quality_config(cache, out, steps, weight_dtype, *extra), RecordingCallbacks())
        losses[name] = json.loads((out / "run.json").read_text(encoding="utf-8"))["losses"]
    gaps = [abs(a - b) / a for a, b in zip(losses["base"], losses["float8"])]
    return {"steps": steps, "weight_dtype": weight_dtype, "storage": storage,
            "mean_loss": {name: statistics.fmean(values) for name, values in losses.items()},
            "last_10_loss": {name: statistics.fmean(values[-10:])
                             for name, values in losses.items()},
            "loss_gap_mean": statistics.fmean(gaps), "loss_gap_max": max(gaps),
            **lora_effect_gap(cache, TORCH_DTYPES[DType(weight_dtype)], work / "base",
                              work / "float8")}
