"""The kinds of GPU validation job: the command each runs, and the row read back from its files.

Every job is its own process, so the phase can kill it at its time limit and a crash is a row.
``train`` runs ``scripts/train.py`` as a user does; ``cell`` runs one timed benchmark cell
(`modules.bench.cell`); ``pytest`` runs tests; ``env``, ``build`` and ``lora`` run the bodies
below as ``python -m modules.bench.gpu_jobs KIND --spec FILE --result FILE``.

A job killed at its limit still tells what it did: train runs and cells keep a
``progress.json`` (step, last compile status) that its row and the runs archive carry, and a
number the job never reported is left out of its row (the tables print "—"), never a zero.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modules.bench.gpu_phases import FULL_SIZES, TINY_SIZES, Size
from modules.bench.gpu_context import Context
from modules.bench.gpu_validate import Job, Kind, has_xdist, python

LORA_PROMPT = "a red square on a wooden table"
PROGRESS_EVERY_SECONDS = 5      # train.py --progress-every: a killed run's last state
PYTEST_INTERRUPT_SECONDS = 20   # SIGINT to pytest, then this long to write its junit file
PYTEST_MARGIN_SECONDS = 10      # a test's own limit ends this much before pytest is stopped
# (width, height) factors of the resolution: wide and square images, four of each, so a batch
# of 2 or 4 is always full and the run goes through exactly two buckets.
BUCKET_IMAGES = [(1.5, 1.0)] * 4 + [(1.0, 1.0)] * 4


def sizes(ctx: Context) -> dict[str, Size]:
    return TINY_SIZES if ctx.tiny else FULL_SIZES


def _write_spec(folder: Path, spec: dict[str, Any]) -> Path:
    path = folder / "spec.json"
    path.write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
    return path


def _body_command(kind: str, folder: Path, spec: dict[str, Any], result: str) -> list[str]:
    return [python(), "-m", "modules.bench.gpu_jobs", kind, "--spec",
            str(_write_spec(folder, spec)), "--result", str(folder / result)]


def built_model_path(ctx: Context, key: str) -> str:
    """The model folder the `build-<key>` job made (a ValueError when it made none)."""
    built = ctx.row(f"build-{key}")
    if built is None or "path" not in built:
        raise ValueError(f"build-{key} has no model path")
    return built["path"]


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


# --- configs -------------------------------------------------------------------------------
def buckets_dataset(folder: Path, resolution: int) -> Path:
    """Noise images in two aspect ratios with captions (made once per resolution)."""
    if (folder / "done").is_file():
        return folder
    from PIL import Image
    folder.mkdir(parents=True, exist_ok=True)
    for i, (w, h) in enumerate(BUCKET_IMAGES):
        size = (int(resolution * w), int(resolution * h))
        Image.effect_noise(size, 20 + 5 * i).convert("RGB").save(folder / f"img{i:02d}.png")
        (folder / f"img{i:02d}.txt").write_text(f"a noisy picture, number {i}", encoding="utf-8")
    (folder / "done").write_text("", encoding="utf-8")
    return folder


def run_config(job: Job, ctx: Context, folder: Path, compile_cache: Path):
    """The training config of a train or cell job: the presets' choices (LoRA, REGIONAL,
    gradient checkpointing, AUTO dynamic shapes), two buckets, bf16 on CUDA; then the job's
    own overrides and the phase's --set."""
    from modules.config import Config, apply_overrides

    key = job.spec["size"]
    size = sizes(ctx)[key]
    model_path = built_model_path(ctx, key)
    data = buckets_dataset(ctx.work / "data" / f"{key}-{size.resolution}", size.resolution)
    cuda = ctx.device == "cuda"
    overrides = [
        f"general.device={ctx.device.upper()}", f"general.cache_dir={ctx.work / 'cache'}",
        f"model.path={model_path}", f"model.type={size.model_type}",
        f"model.weight_dtype={'BFLOAT16' if cuda else 'FLOAT32'}",
        "data.datasets=" + json.dumps([{"path": str(data)}]),
        f"data.resolution={size.resolution}", "data.aspect_buckets=true",
        "data.cache_latents=true", "data.workers=0",
        "training.method=LORA", "training.lora_rank=16", "training.lora_alpha=16",
        "training.learning_rate=0.0001", "training.lr_scheduler=CONSTANT",
        "training.lr_warmup_steps=0", f"training.max_steps={size.steps}",
        f"training.batch_size={size.batch}", "training.gradient_checkpointing=true",
        f"training.mixed_precision={'BF16' if cuda else 'NO'}", "training.seed=1",
        f"compile.backend={job.spec['backend']}", "compile.denoiser=true", "compile.scope=REGIONAL",
        "compile.dynamic=AUTO", f"compile.cache_dir={compile_cache}",
        "sampling.prompts=" + json.dumps([LORA_PROMPT]),
        f"sampling.every_steps={size.sample_every}", f"sampling.steps={size.sample_steps}",
        f"output.dir={folder / 'out'}", f"output.save_every_steps={size.save_every}",
        "output.overwrite=true", 'output.formats=["DIFFUSERS", "KOHYA"]',
        "logging.tensorboard=false",
    ]
    return apply_overrides(Config(), overrides + list(size.overrides)
                           + list(job.spec.get("overrides", [])) + list(ctx.overrides))


def _fresh(folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    return folder


# --- train ---------------------------------------------------------------------------------
def train_command(job: Job, ctx: Context, folder: Path) -> list[str]:
    from modules.config import save_config

    config = run_config(job, ctx, folder, _fresh(ctx.compile_cache() / job.name))
    save_config(config, folder / "config.json")
    # The progress file, not --quiet: a run killed at its limit leaves its step and its last
    # compile status there, and its status and compile lines in the log.
    return [python(), "scripts/train.py", "--config", str(folder / "config.json"),
            "--progress-file", str(folder / "progress.json"),
            "--progress-every", str(PROGRESS_EVERY_SECONDS)]


def read_progress(folder: Path) -> dict[str, Any] | None:
    """The job's last progress.json (None: it never wrote one)."""
    try:
        return _read(folder / "progress.json")
    except (OSError, ValueError):
        return None


def train_collect(job: Job, ctx: Context, folder: Path) -> dict[str, Any]:
    progress = read_progress(folder)
    try:
        record = _read(folder / "out" / "run.json")
    except (OSError, ValueError) as err:  # killed before train.py wrote its record
        return {"progress": progress, "collect_error": f"{type(err).__name__}: {err}"}
    row = {**run_numbers(record), "progress": progress}
    row["status"] = "ok" if record.get("status") == "finished" else "failed"
    if row["status"] != "ok":
        row["error"] = record.get("error") or f"run ended {record.get('status')}"
    return row


def run_numbers(record: dict[str, Any]) -> dict[str, Any]:
    """A run.json folded into one row: what compiled, how long, recompiles, memory, loss. A
    run that did not reach its end has no compile report yet: those numbers are None (the
    tables print "—"), not the zeros of an empty report."""
    from modules.bench.cell import summarize_compile

    report = record.get("compile")
    compiled: dict[str, Any] = summarize_compile(report) if report is not None else {}
    shapes = record.get("batch_shapes") or {}
    memory = record.get("memory") or {}
    losses = [x for x in record.get("losses", []) if x is not None]
    return {
        "effective": compiled.get("effective"), "fallbacks": compiled.get("fallbacks"),
        "degraded": compiled.get("degraded"), "compile_seconds": compiled.get("compile_seconds"),
        "recompiles": compiled.get("recompiles"),
        "recompiles_after_first_pass": shapes.get("recompiles_after_first_pass"),
        "late_recompiles": (sum(r.get("late_recompiles", 0) for r in report.values())
                            if report is not None else None),
        "cache": compiled.get("cache"), "compiled_code_ran": compiled.get("compiled_code_ran"),
        "cudagraphs": (any(r.get("cudagraphs") for r in report.values())
                       if report is not None else None),
        "first_step_seconds": record.get("first_step_seconds"),
        "median_step_seconds": record.get("median_step_seconds"),
        "steps_done": record.get("steps_done"), "first_loss": losses[0] if losses else None,
        "final_loss": record.get("final_loss"), "skipped_steps": record.get("skipped_steps"),
        "peak_allocated_bytes": memory.get("peak_allocated_bytes"),
        "peak_reserved_bytes": memory.get("peak_reserved_bytes"),
        "peak_rss_bytes": memory.get("peak_rss_bytes"),
        # the up-front lower bound (weights, gradients, optimizer state), beside the peaks
        "memory_plan_bytes": (record.get("memory_plan") or {}).get("total_bytes"),
        "precision": record.get("precision"), "device_name": record.get("device"),
        "wall_seconds": record.get("wall_seconds"),
    }


# --- cell ------------------------------------------------------------------------------------
def cell_command(job: Job, ctx: Context, folder: Path) -> list[str]:
    from modules.bench.cell import step_cap, stop_time
    from modules.bench.matrix import Cell, cell_config
    from modules.config import to_dict

    warm_from = job.spec.get("warm_from")
    # bundle_from: an empty cache folder of its own, and only the compile bundle the job
    # named wrote (a new machine's start: docs/compilation.md "Compile bundles")
    bundle_from = job.spec.get("bundle_from")
    cache = ctx.compile_cache() / (warm_from or job.name)
    bundles = ctx.compile_cache() / bundle_from / "bundles" if bundle_from else None
    warm = (bool(warm_from) and cache.is_dir() and any(cache.rglob("*"))) or (
        bundles is not None and any(bundles.glob("*.tcb")))
    if not warm_from:
        _fresh(cache)
    base = run_config(job, ctx, folder, cache)
    if bundles is not None:
        base.compile.bundle = str(bundles)
    cell = Cell(job.spec["backend"], "unet", base.compile.scope.value, base.compile.dynamic.value)
    warmup, steps = 1, sizes(ctx)[job.spec["size"]].cell_steps
    config = cell_config(base, cell, max_steps=step_cap(warmup, steps), output_dir=folder / "out",
                         compile_cache_dir=cache)
    (folder / "cache.json").write_text(json.dumps({"warm_cache_found": warm,
                                                   "cache_folder": str(cache),
                                                   "bundle_from": bundle_from}) + "\n", "utf-8")
    # ``job.limit_s`` is the limit it got (the budget's cut): the cell stops itself before it,
    # so a cold start that leaves it a short steady window still brings back a median.
    spec = {"config": to_dict(config), "steps": steps, "warmup": warmup,
            "phase": "warm" if warm else "cold", "progress": str(folder / "progress.json"),
            "stop_at": stop_time(job.limit_s)}
    path = folder / "cell-spec.json"
    path.write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
    return [python(), "-m", "modules.bench.cell", "--spec", str(path),
            "--result", str(folder / "result.json")]


def cell_collect(job: Job, ctx: Context, folder: Path) -> dict[str, Any]:
    progress = read_progress(folder)
    try:
        result = _read(folder / "result.json")
    except (OSError, ValueError) as err:  # killed before it wrote its result
        return {"progress": progress, **_read(folder / "cache.json"),
                "collect_error": f"{type(err).__name__}: {err}"}
    keep = ("status", "error", "median_step_seconds", "first_step_seconds",
            "first_step_overhead_seconds", "timed_steps", "compile_steps", "step_seconds",
            "cudagraphs", "peak_allocated_bytes", "peak_reserved_bytes", "peak_rss_bytes",
            "graph_breaks", "graphs_after_warmup", "compile_seconds", "recompiles",
            "fallbacks", "degraded", "effective", "cache", "bundle", "compiled_code_ran", "timing",
            "steps_wanted", "partial", "stopped_at_time_limit")
    row = {k: result.get(k) for k in keep if k in result}
    row.update(_read(folder / "cache.json"))
    return row


# --- pytest ----------------------------------------------------------------------------------
def pytest_command(job: Job, ctx: Context, folder: Path) -> list[str]:
    """-v: the log tail names each test and its outcome. A test's own time limit ends before
    the job's (``job.limit_s``, the limit it got), so a hung test fails as a test; at the
    job's limit pytest gets SIGINT first (`Kind.interrupt_s`) and writes its junit file."""
    per_test = min(job.spec.get("per_test", 300),
                   job.limit_s - PYTEST_INTERRUPT_SECONDS - PYTEST_MARGIN_SECONDS)
    command = [python(), "-m", "pytest", *job.spec["paths"], "-v", "-p", "no:cacheprovider",
               "--timeout", str(max(10, int(per_test))),
               "--junitxml", str(folder / "junit.xml")]
    if ctx.device == "cuda" and has_xdist():
        command += ["-n", "4"]
    return command


def pytest_collect(job: Job, ctx: Context, folder: Path) -> dict[str, Any]:
    """Counts and each failure's first line, from the junit XML; written as tests.json."""
    root = ElementTree.parse(folder / "junit.xml").getroot()
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures: list[dict[str, str]] = []
    skips: set[str] = set()
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            counts["failed"] += 1
            failures.append({"test": name,
                             "message": "".join((problem.get("message") or "").splitlines()[:1])})
        elif skipped is not None:
            counts["skipped"] += 1
            skips.add((skipped.get("message") or "").splitlines()[0][:200]
                      if skipped.get("message") else "skipped")
        else:
            counts["passed"] += 1
    row: dict[str, Any] = {**counts, "failures": failures, "skip_reasons": sorted(skips)}
    (folder / "tests.json").write_text(json.dumps(row, indent=2) + "\n", encoding="utf-8")
    if counts["failed"]:
        row.update(status="failed", error=f"{counts['failed']} failed: "
                   + ", ".join(f["test"] for f in failures[:5]))
    elif not counts["passed"] and not counts["skipped"]:
        row.update(status="failed", error="no test ran")
    else:
        row["status"] = "ok"
    return row


# --- env, build, lora: run in the job's own process (main below) -----------------------------
def env_command(job: Job, ctx: Context, folder: Path) -> list[str]:
    return _body_command("env", folder, {"device": ctx.device}, "env.json")


def build_command(job: Job, ctx: Context, folder: Path) -> list[str]:
    return _body_command("build", folder, {**job.spec, "device": ctx.device,
                                           "cache_dir": str(ctx.work / "cache")}, "model.json")


def lora_command(job: Job, ctx: Context, folder: Path) -> list[str]:
    key = job.spec["size"]
    size = sizes(ctx)[key]
    trained = ctx.job_dir(job.spec["train_job"]) / "out"
    return _body_command("lora", folder, {
        "device": ctx.device, "model_path": built_model_path(ctx, key),
        "final": str(trained / "final"), "resolution": size.resolution,
        "steps": 4 if not ctx.tiny else 2}, "lora.json")


def result_collect(name: str):
    def collect(job: Job, ctx: Context, folder: Path) -> dict[str, Any]:
        return _read(folder / name)
    return collect


def env_body(spec: dict[str, Any]) -> dict[str, Any]:
    """GPU (its name: the one place the phase reads it), driver, library versions, TF32 as
    the runs set it, and whether each compile backend can run here."""
    import dataclasses

    import torch

    from modules.bench.gpu_machine import versions
    from modules.compile.capabilities import backend_problem, detect_capabilities
    from modules.config.schema import CompileBackend

    cuda = spec["device"] == "cuda" and torch.cuda.is_available()
    caps = detect_capabilities("cuda" if cuda else "cpu")
    info: dict[str, Any] = {
        "versions": versions(), "cuda_available": torch.cuda.is_available(),
        "capabilities": {k: (sorted(v) if isinstance(v, frozenset) else v)
                         for k, v in dataclasses.asdict(caps).items()},
        "backends": {b.value: backend_problem(b, caps) or "runs" for b in CompileBackend},
    }
    try:
        info["tf32"] = runs_tf32("cuda" if cuda else "cpu")
    except Exception as err:  # noqa: BLE001 - the row says so; the GPU's name still matters
        traceback.print_exc()
        info["tf32"] = {"error": f"{type(err).__name__}: {err}"}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                       "memory_gib": round(props.total_memory / 2**30, 1),
                       "multiprocessors": props.multi_processor_count,
                       "bf16": torch.cuda.is_bf16_supported()}
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                              "clocks.max.sm,power.limit", "--format=csv"],
                             capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    return info


def runs_tf32(device: str) -> dict[str, Any]:
    """TF32 as the runs set it: the trainer's own switch (`float32_precision`) applied to the
    runs' config on ``device`` (`run_config` leaves `training.allow_tf32` at its default),
    what torch then reports, then put back."""
    import torch

    from modules.config import Config, apply_overrides
    from modules.train.recipe.builders import float32_precision

    config = apply_overrides(Config(), [f"general.device={device.upper()}"])
    restore, record = float32_precision(config, torch.device(device))
    try:
        return {**record, "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}
    finally:
        restore()


def build_body(spec: dict[str, Any]) -> dict[str, Any]:
    """The model's folder: a built-in tiny model, or a benchmark model built once. Big ones
    are initialised on the GPU when there is one (minutes on the CPU at SDXL size), and on
    the CPU when that raises; ``built_on`` says which, ``gpu_build_error`` why."""
    import torch

    from modules.bench.models import ensure_bench_model, unet_parameter_count
    from modules.models.tiny import ensure_builtin_model

    started = time.perf_counter()
    cache = Path(spec["cache_dir"])
    name = spec["model"]
    found: dict[str, Any] = {}
    if name.startswith("builtin:"):
        path, parameters = str(ensure_builtin_model(name, cache)), None
        found["built_on"] = "cpu"
    else:
        cuda = spec["device"] == "cuda" and torch.cuda.is_available()
        path, found = on_gpu_else_cpu(lambda: ensure_bench_model(name, cache), cuda)
        parameters = unet_parameter_count(name)
    size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
    return {"path": path, "unet_parameters": parameters, "folder_bytes": size, **found,
            "build_seconds": round(time.perf_counter() - started, 1)}


def on_gpu_else_cpu(build: Callable[[], Any], cuda: bool) -> tuple[Any, dict[str, Any]]:
    """``build()`` under the CUDA device context (tensors it makes start on the GPU), and again
    on the CPU when that raises: the result, and where it was built (with the GPU's error).
    The GPU path has never run before a lent machine: a failure there must not cost the phase
    its model."""
    import torch

    if not cuda:
        return build(), {"built_on": "cpu"}
    try:
        with torch.device("cuda"):
            return build(), {"built_on": "cuda"}
    except Exception as err:  # noqa: BLE001 - recorded in the row and the log, then the CPU
        traceback.print_exc()
        error = f"{type(err).__name__}: {err}"[:500]
    print(f"building on the GPU failed ({error}); building on the CPU", file=sys.stderr)
    return build(), {"built_on": "cpu", "gpu_build_error": error}


def lora_body(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the base model as a diffusers pipeline, generate, load each saved LoRA file (the
    diffusers and the kohya layout), generate again: the output must change and stay finite."""
    import numpy as np
    import torch
    from diffusers import DiffusionPipeline

    device = "cuda" if spec["device"] == "cuda" and torch.cuda.is_available() else "cpu"
    # fp32: a LoRA after a short run is a small change; half precision could round it away.
    pipe = DiffusionPipeline.from_pretrained(spec["model_path"], torch_dtype=torch.float32,
                                             local_files_only=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    res = spec["resolution"]

    def generate() -> np.ndarray:
        generator = torch.Generator("cpu").manual_seed(0)
        return pipe(LORA_PROMPT, num_inference_steps=spec["steps"], height=res, width=res,
                    guidance_scale=5.0, generator=generator, output_type="np").images

    before = generate()
    files: dict[str, Any] = {}
    final = Path(spec["final"])
    for weight in sorted(p.name for p in final.glob("*.safetensors")):
        pipe.load_lora_weights(str(final), weight_name=weight, adapter_name="check")
        adapters = pipe.get_list_adapters()
        after = generate()
        pipe.unload_lora_weights()
        change = np.abs(after.astype(np.float64) - before)
        files[weight] = {"adapters": {k: list(v) for k, v in adapters.items()},
                         "finite": bool(np.isfinite(after).all()),
                         "mean_abs_change": float(change.mean()),
                         "max_abs_change": float(change.max())}
    if not files:
        return {"status": "failed", "error": f"no .safetensors in {final}", "files": {}}
    bad = [name for name, f in files.items()
           if not (f["adapters"] and f["finite"] and f["mean_abs_change"] > 0)]
    return {"status": "failed" if bad else "ok", "device": device, "files": files,
            "error": f"loaded without effect or non-finite: {', '.join(bad)}" if bad else None}


BODIES = {"env": env_body, "build": build_body, "lora": lora_body}

KINDS: dict[str, Kind] = {
    "env": Kind(env_command, result_collect("env.json")),
    "pytest": Kind(pytest_command, pytest_collect, interrupt_s=PYTEST_INTERRUPT_SECONDS),
    "build": Kind(build_command, result_collect("model.json")),
    "train": Kind(train_command, train_collect),
    "cell": Kind(cell_command, cell_collect),
    "lora": Kind(lora_command, result_collect("lora.json")),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one GPU validation job body.")
    parser.add_argument("kind", choices=sorted(BODIES))
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--result", required=True, type=Path)
    args = parser.parse_args(argv)
    spec = _read(args.spec)
    try:
        result = BODIES[args.kind](spec)
    except Exception as err:  # the job's failure is its row; the traceback goes to its log
        traceback.print_exc()
        result = {"status": "failed", "error": f"{type(err).__name__}: {err}"}
    args.result.write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    return 0 if result.get("status", "ok") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
