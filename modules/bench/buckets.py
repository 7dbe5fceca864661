"""Aspect-ratio buckets under compilation: compile time and recompiles per scope x dynamic.

Each setting trains the tiny SD 1.5 model in its own `tempera-train` process (fresh compiler
state) on a generated dataset with three aspect ratios, and the numbers are read back from the
run's own `run.json` (`compile.denoiser`, `batch_shapes`). Writes `buckets.json` and `buckets.md`.
The command line is ``scripts/benchmark_compile.py buckets`` (`modules.bench.cli`).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from modules.bench.report import machine_info
from modules.bench.matrix import default_precision, set_precision
from modules.config import Config, apply_overrides, save_config
from modules.config.schema import Device

REPO = Path(__file__).resolve().parents[2]
# PIL (width, height): wide, square and tall images, two of each; at resolution 256 they land
# in the buckets 192x320, 256x256 and 320x192 (height x width).
IMAGE_SIZES = [(120, 60), (120, 60), (64, 64), (64, 64), (60, 120), (60, 120)]
SCOPES, DYNAMIC = ("REGIONAL", "FULL"), ("DYNAMIC", "AUTO", "STATIC")


def make_dataset(folder: Path) -> Path:
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(IMAGE_SIZES):
        Image.effect_noise(size, 30 + i).convert("RGB").save(folder / f"img{i:02d}.png")
        (folder / f"img{i:02d}.txt").write_text(f"a noisy picture number {i}", encoding="utf-8")
    return folder


def bucket_config(out: Path, data: Path, cache_dir: str, backend: str, scope: str,
                  dynamic: str, epochs: int, device: str = "AUTO",
                  precision: str | None = None) -> Config:
    """The training config of one setting; ``precision`` None: bf16 on CUDA, fp32 on the CPU."""
    name = f"{scope.lower()}-{dynamic.lower()}"
    config = apply_overrides(Config(), [
        f"general.cache_dir={cache_dir}", f"general.device={Device(device.upper()).value}",
        f"data.datasets=[{{\"path\": \"{data}\"}}]", "data.resolution=256",
        "data.aspect_buckets=true", "training.batch_size=2", f"training.epochs={epochs}",
        "training.max_steps=0", "training.learning_rate=1e-3", f"compile.backend={backend}",
        "compile.denoiser=true", f"compile.scope={scope}", f"compile.dynamic={dynamic}",
        "sampling.prompts=[]", "logging.tensorboard=false", f"output.dir={out / name}",
        "output.overwrite=true"])
    set_precision(config, precision or default_precision(config))
    return config


def run_setting(out: Path, data: Path, cache_dir: str, backend: str, scope: str,
                dynamic: str, epochs: int, device: str = "AUTO",
                precision: str | None = None) -> dict[str, Any]:
    """Train one setting in a fresh process; its row from the run's run.json."""
    name = f"{scope.lower()}-{dynamic.lower()}"
    config = bucket_config(out, data, cache_dir, backend, scope, dynamic, epochs, device,
                           precision)
    config_file = out / f"{name}.json"
    save_config(config, config_file)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train.py"), "--config",
                           str(config_file), "--quiet"], capture_output=True, text=True)
    row: dict[str, Any] = {"scope": scope, "dynamic": dynamic, "exit_code": proc.returncode}
    if proc.returncode != 0:
        row["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return row
    record = json.loads((out / name / "run.json").read_text())
    shapes, unet = record["batch_shapes"], record["compile"]["unet"]
    row.update(device=record.get("device"), steps=record["steps_done"], shapes=shapes["distinct"],
               compile_seconds=unet["compile_seconds"],
               recompiles_in_first_pass=shapes["recompiles_in_first_pass"],
               recompiles_after_first_pass=shapes["recompiles_after_first_pass"],
               compiled_code_ran=unet["compiled_code_ran"])
    return row


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [f"{result['backend']}, tiny SD 1.5 UNet, resolution 256 (buckets 192x320, 256x256, "
             f"320x192), two images per bucket, batch 2, {result['epochs']} epochs, "
             f"{result.get('precision', 'fp32')}.",
             f"Device: {device_text(result)}; torch {m['torch']}; {m['date']}; "
             f"load average at start {m.get('load_average_start', ['?'])[0]}.", "",
             "| scope | dynamic | steps | shapes | UNet compile s | recompiles (first pass) "
             "| recompiles after first pass |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["exit_code"] != 0:
            lines.append(f"| {r['scope']} | {r['dynamic']} | failed: {r['error']} | | | | |")
            continue
        lines.append(f"| {r['scope']} | {r['dynamic']} | {r['steps']} | {r['shapes']} | "
                     f"{r['compile_seconds']:.1f} | {r['recompiles_in_first_pass']} | "
                     f"{r['recompiles_after_first_pass']} |")
    return "\n".join(lines) + "\n"


def device_text(result: dict[str, Any]) -> str:
    """The device the rows ran on, as the run records say (CUDA: the GPU's name)."""
    m = result["machine"]
    ran_on = {str(r.get("device")) for r in result["rows"] if r.get("device")}
    if any(d.startswith("cuda") for d in ran_on) and m.get("cuda_device"):
        return f"{m['cuda_device']} (CUDA)"
    return f"CPU {m['cpu']}, {m['cpu_cores']} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmark_compile.py buckets",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--backend", default="AOT_EAGER")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--scopes", default=",".join(SCOPES), help="comma list")
    parser.add_argument("--dynamic", default=",".join(DYNAMIC), help="comma list")
    parser.add_argument("--device", default="auto",
                        choices=[d.value.lower() for d in Device],
                        help="general.device (default auto: CUDA when there is one)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                        help="mixed precision + frozen weight dtype (default bf16 on CUDA, "
                             "fp32 on the CPU)")
    parser.add_argument("--cache-dir", default="",
                        help="general.cache_dir, where the built-in tiny model is built")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = make_dataset(out / "data")
    probe = bucket_config(out, data, args.cache_dir, args.backend, SCOPES[0], DYNAMIC[0],
                          args.epochs, args.device, args.precision)
    precision = args.precision or default_precision(probe)
    result = {"machine": machine_info(), "backend": args.backend, "epochs": args.epochs,
              "device": args.device, "precision": precision, "rows": []}
    settings = [(scope, dynamic) for scope in args.scopes.split(",")
                for dynamic in args.dynamic.split(",")]
    for scope, dynamic in settings:
        row = run_setting(out, data, args.cache_dir, args.backend, scope, dynamic, args.epochs,
                          args.device, precision)
        print(f"{scope} {dynamic}: {row}", flush=True)
        result["rows"].append(row)
    (out / "buckets.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "buckets.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if all(r["exit_code"] == 0 for r in result["rows"]) else 1
