"""The benchmark's one command line (``scripts/benchmark_compile.py`` calls `main`).

Two subcommands: ``matrix`` (the default when none is named: every backend side by side) and
``buckets`` (compile time and recompiles across aspect-ratio buckets, `modules.bench.buckets`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from modules.bench.apply import ApplyError, apply_fastest, is_builtin_preset
from modules.bench.matrix import COMPONENT_SETS, default_precision, model_config, set_precision
from modules.bench.models import BENCH_MODELS, ensure_bench_model, unet_parameter_count
from modules.bench.runner import BenchProgress, run_benchmark
from modules.config import Config, ConfigError, apply_overrides, load_config
from modules.config.schema import Device, TrainingMethod
from modules.paths import cache_dir_for

METHODS = {"lora": TrainingMethod.LORA, "finetune": TrainingMethod.FINE_TUNE}
SUBCOMMANDS = ("matrix", "buckets")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="benchmark_compile.py [matrix]",
        description="Side-by-side compile benchmark: every cell of the matrix trains a few steps "
                    "in its own process; outputs benchmark.json/.md/.png. The other subcommand, "
                    "'buckets', measures compiles across aspect-ratio buckets (its own --help).")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--config", type=Path, help="benchmark this training config")
    source.add_argument("--model", choices=sorted(BENCH_MODELS),
                        help="a model shape built locally with random weights (default tiny)")
    p.add_argument("--resolution", type=int, help="pixels (default: the model's / config's)")
    p.add_argument("--batch", type=int, help="batch size (default 4 / the config's)")
    p.add_argument("--method", choices=sorted(METHODS), help="default lora / the config's")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                   help="mixed precision + frozen weight dtype (default with --model: bf16 on "
                        "CUDA, fp32 on the CPU; with --config: the config's)")
    p.add_argument("--device", choices=[d.value.lower() for d in Device],
                   help="general.device (default: the config's, AUTO)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config override, as in train.py")
    p.add_argument("--steps", type=int, default=10, help="timed steps per cell (default 10)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps first, >= 1 (default 1); later steps that compiled or "
                        "recorded CUDA graphs are left out of the median as well")
    p.add_argument("--backends", type=_csv, default=["NONE", "AOT_EAGER", "INDUCTOR"],
                   help="comma list of compile backends (NONE is always run: the baseline)")
    p.add_argument("--components", type=_csv,
                   help=f"comma list of {'/'.join(COMPONENT_SETS)} (default: the config's)")
    p.add_argument("--scopes", type=_csv, help="comma list of FULL,REGIONAL (default: config's)")
    p.add_argument("--dynamic", type=_csv,
                   help="comma list of DYNAMIC,AUTO,STATIC (default: the config's)")
    p.add_argument("--cell-timeout", type=float,
                   help="seconds per cell process before it is killed and recorded as timeout "
                        "(default: scaled with the UNet's size and the backend's autotuning)")
    p.add_argument("--no-warm-start", dest="warm_start", action="store_false",
                   help="skip the second (warm cache) process of each compiled cell")
    p.add_argument("--cache-dir", help="general.cache_dir (built models, datasets)")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--apply", type=Path, metavar="PRESET",
                   help="write the fastest working backend/components/scope into this preset")
    p.add_argument("--force", action="store_true",
                   help="allow --apply to change a preset that ships with Tempera")
    return p


def benchmark_config(args: argparse.Namespace) -> tuple[Config, dict]:
    """The base config the matrix runs on, and the settings that describe where it came from."""
    if args.config:
        config = load_config(args.config)
        extra: dict[str, Any] = {"config": str(args.config)}
    else:
        config = Config()
        extra = {}
    if args.cache_dir:
        config.general.cache_dir = args.cache_dir
    if args.device:
        config.general.device = Device(args.device.upper())
    if not args.config:
        name = args.model or "tiny"
        model = BENCH_MODELS[name]
        path = ensure_bench_model(name, cache_dir_for(config.general.cache_dir))
        config = model_config(config, model_path=path, model_type=model.model_type,
                              resolution=args.resolution or model.default_resolution,
                              batch=args.batch or 4, method=METHODS[args.method or "lora"],
                              precision=args.precision or default_precision(config))
        extra = {"model": name, "unet_parameters": unet_parameter_count(name)}
    else:
        if args.resolution:
            config.data.resolution = args.resolution
        if args.batch:
            config.training.batch_size = args.batch
        if args.method:
            config.training.method = METHODS[args.method]
        set_precision(config, args.precision)
    return apply_overrides(config, args.overrides), extra


def _print_progress(event: BenchProgress) -> None:
    print(f"[{event.index}/{event.total}] {event.cell}: {event.phase} — {event.message}",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``matrix`` (default) or ``buckets``; see `run_matrix` and `modules.bench.buckets.main`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "buckets":
        from modules.bench.buckets import main as buckets_main
        return buckets_main(argv[1:])
    if argv and argv[0] == "matrix":
        argv = argv[1:]
    return run_matrix(argv)


def run_matrix(argv: list[str]) -> int:
    """Run the benchmark; 0 when it ran (failing cells are rows), 2 bad input, 1 --apply refused."""
    args = build_parser().parse_args(argv)
    if args.apply and is_builtin_preset(args.apply) and not args.force:
        # Refuse before spending minutes on the benchmark.
        print(f"error: --apply: {args.apply} ships with Tempera (training_presets/); apply to a "
              "copy, or pass --force", file=sys.stderr)
        return 1
    try:
        config, extra = benchmark_config(args)
        result = run_benchmark(config, backends=args.backends, components=args.components,
                               scopes=args.scopes, dynamic=args.dynamic, steps=args.steps,
                               warmup=args.warmup, warm_start=args.warm_start,
                               cell_timeout=args.cell_timeout, out_dir=args.out,
                               progress=_print_progress, extra_settings=extra)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    paths = result.write(args.out)
    print(result.markdown())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if any(cell["status"] == "timeout" for cell in result.cells):
        print("a cell timed out: --cell-timeout SECONDS gives every cell that long",
              file=sys.stderr)
    if args.apply:
        try:
            applied = apply_fastest(result, args.apply, force=args.force)
        except ApplyError as err:
            print(f"error: --apply: {err}", file=sys.stderr)
            return 1
        print(f"applied {applied['backend']} / {applied['components']} / {applied['scope']} / "
              f"{applied['dynamic']} ({applied['note']}) to {applied['preset']}")
    return 0
