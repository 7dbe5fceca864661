"""The GPU validation's phases, as data: what each runs, in order of value, and its time limits.

Each phase fits one command on the lending machine (at most 10 minutes: the phase's budget is
9). Phases 2 and 5 train through `scripts/train.py` exactly as a user does, with the compiled
runs side by side to fit their cold starts in one command (their step times share the GPU:
phases 3, 4 and 7 time each setting alone). `--tiny` swaps the SD-size random-weight models for
the built-in tiny ones and shortens every run: the CPU suite rehearses every phase that way.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from modules.bench.gpu_validate import Job


@dataclass(frozen=True)
class Size:
    """How big the runs of one model are: the full size, or the rehearsal's tiny one."""
    model: str              # build job spec: a benchmark model (modules.bench.models) or builtin
    model_type: str         # SD15 | SDXL
    resolution: int
    batch: int
    steps: int              # optimizer steps of a train job
    sample_every: int       # a sample (and so the sampling graphs) inside the run
    sample_steps: int
    save_every: int         # a checkpoint inside the run
    cell_steps: int         # clean steps a timed cell measures
    limit_scale: float = 1.0


FULL_SIZES = {
    "sd15": Size("sd15", "SD15", 512, 2, 20, 10, 8, 10, cell_steps=15),
    "sdxl": Size("sdxl", "SDXL", 1024, 2, 12, 6, 6, 6, cell_steps=10),
}
# 192 px: the smallest resolution with a bucket besides the square one (sides are multiples
# of 64), so the rehearsal goes through two buckets too.
TINY_SIZES = {
    "sd15": Size("builtin:tiny-sd15", "SD15", 192, 2, 4, 2, 2, 2, cell_steps=3),
    "sdxl": Size("builtin:tiny-sdxl", "SDXL", 192, 2, 4, 2, 2, 2, cell_steps=3),
}

# Phase 2's runs: the backends as the presets run them (REGIONAL, gradient checkpointing), and
# TRITON FULL without checkpointing: the one setting where the plan keeps CUDA graphs (with
# persistent gradients) at SD size.
SD15_TRAIN_RUNS: list[tuple[str, str, list[str]]] = [
    ("none", "NONE", []),
    ("aot_eager", "AOT_EAGER", []),
    ("default", "DEFAULT", []),
    ("inductor", "INDUCTOR", []),
    ("triton", "TRITON", []),
    ("triton-full", "TRITON", ["compile.scope=FULL", "training.gradient_checkpointing=false"]),
]
SDXL_TRAIN_RUNS: list[tuple[str, str, list[str]]] = [
    ("none", "NONE", []),
    ("default", "DEFAULT", []),
    ("inductor", "INDUCTOR", []),
    ("fp16", "NONE", ["training.mixed_precision=FP16", "model.weight_dtype=FLOAT16"]),  # CUDA
    ("triton", "TRITON", []),
]


# Full fine-tunes save the whole model (the kohya layout is for LoRA files only).
FINE_TUNE = ["training.method=FINE_TUNE", 'output.formats=["DIFFUSERS"]']


def _build(key: str, size: Size) -> Job:
    return Job(f"build-{key}", "build", 300 * size.limit_scale,
               {"model": size.model, "model_type": size.model_type,
                "resolution": size.resolution},
               answers="the random-weight model at full architecture, built on this machine")


def _train(key: str, size: Size, name: str, backend: str, extra: list[str],
           limit: float, group: str | None = "train", answers: str = "") -> Job:
    # FP16 autocast exists only on CUDA: the CPU rehearsal records such a run as not started.
    needs_cuda = "training.mixed_precision=FP16" in extra
    return Job(f"train-{key}-{name}", "train", limit * size.limit_scale,
               {"size": key, "backend": backend, "overrides": extra, "model": size.model,
                "needs_cuda": needs_cuda},
               group=group, after=(f"build-{key}",),
               answers=answers or f"{backend} trains {key} through train.py: effective backend, "
                                  "compile time, recompiles, memory")


def _lora(key: str, run: str) -> Job:
    # In the train group: it starts as soon as its run has ended, beside the others.
    return Job(f"lora-{key}-{run}", "lora", 180, {"size": key, "train_job": f"train-{key}-{run}"},
               group="train", after=(f"train-{key}-{run}",),
               answers="the saved LoRA loads into a diffusers pipeline and changes its output")


def _cell(key: str, size: Size, name: str, backend: str, extra: list[str], limit: float,
          warm_from: str | None, answers: str, compare_with: str | None = None) -> Job:
    """A timed cell, alone; ``warm_from``: the train job whose compile cache it starts from;
    ``compare_with``: the cell (same phase) its speed-up is against (default: eager)."""
    return Job(f"cell-{key}-{name}", "cell", limit * size.limit_scale,
               {"size": key, "backend": backend, "overrides": extra, "model": size.model,
                "warm_from": warm_from,
                "compare_with": None if name == "none" else compare_with or f"cell-{key}-none"},
               after=(f"build-{key}",), answers=answers)


def phase_env(sizes: dict[str, Size]) -> list[Job]:
    return [
        Job("env", "env", 90, answers="GPU, driver, versions and what each backend can use"),
        Job("tests-gpu", "pytest", 420,
            {"paths": ["tests/gpu", "tests/bench/test_benchmark_cuda.py"], "per_test": 300},
            answers="the CUDA-only tests (tests/gpu and the CUDA benchmark test)"),
    ]


def phase_sd15(sizes: dict[str, Size]) -> list[Job]:
    size = sizes["sd15"]
    jobs = [_build("sd15", size)]
    jobs += [_train("sd15", size, name, backend, extra, 330)
             for name, backend, extra in SD15_TRAIN_RUNS]
    # A compiled run's LoRA too: a compile wrapper's names must not leak into the saved keys.
    jobs += [_lora("sd15", "inductor"), _lora("sd15", "aot_eager"), _lora("sd15", "none")]
    return jobs


def phase_sd15_warm(sizes: dict[str, Size]) -> list[Job]:
    size = sizes["sd15"]
    jobs = [_build("sd15", size)]
    for name, backend, extra in SD15_TRAIN_RUNS:
        if backend == "AOT_EAGER":  # a debugging backend: its speed is not a question on a GPU
            continue
        jobs.append(_cell("sd15", size, name, backend, extra, 150, f"train-sd15-{name}",
                          "steady step time, ratio to eager, warm first step, memory, alone"))
    for name, backend in (("channels-last-none", "NONE"), ("channels-last-inductor", "INDUCTOR")):
        jobs.append(_cell("sd15", size, name, backend, ["training.channels_last=true"], 240,
                          None, "does channels_last pay (against the same backend without)",
                          compare_with=f"cell-sd15-{backend.lower()}"))
    return jobs


def phase_sd15_more(sizes: dict[str, Size]) -> list[Job]:
    size = sizes["sd15"]
    jobs = [_build("sd15", size)]
    for backend in ("NONE", "INDUCTOR"):
        jobs.append(_cell("sd15", size, f"finetune-{backend.lower()}", backend,
                          FINE_TUNE, 300, None,
                          "full fine-tune: step time and peak memory, eager vs compiled",
                          compare_with="cell-sd15-finetune-none"))
    # Last: max_autotune's cold start may not fit at all (public figures: 4-25 min at SD
    # size); then its row says how long it ran, which answers the question too.
    jobs += [_cell("sd15", size, "default", "DEFAULT", [], 150, "train-sd15-default",
                   "DEFAULT, warm when phase 2's cache is here: what max_autotune is against"),
             _cell("sd15", size, "inductor-autotune", "INDUCTOR", ["compile.mode=MAX_AUTOTUNE"],
                   480, None, "is max_autotune's cold start worth its step time at SD size",
                   compare_with="cell-sd15-default")]
    return jobs


def phase_sdxl(sizes: dict[str, Size]) -> list[Job]:
    size = sizes["sdxl"]
    jobs = [_build("sdxl", size)]
    jobs += [_train("sdxl", size, name, backend, ["data.cache_text_encoder_outputs=true", *extra],
                    400, answers=f"{backend} trains SDXL at {size.resolution} px"
                    + (" in fp16: the VAE gives finite latents" if name == "fp16" else ""))
             for name, backend, extra in SDXL_TRAIN_RUNS]
    jobs += [_lora("sdxl", "inductor"), _lora("sdxl", "none")]
    return jobs


def phase_rest(sizes: dict[str, Size]) -> list[Job]:
    sd15, sdxl = sizes["sd15"], sizes["sdxl"]
    return [
        _build("sd15", sd15),
        _train("sd15", sd15, "inductor-full", "INDUCTOR",
               ["compile.scope=FULL", "training.gradient_checkpointing=false"], 480, group=None,
               answers="FULL-scope INDUCTOR at SD size: cold start and speed against REGIONAL"),
        _build("sdxl", sdxl),
        _train("sdxl", sdxl, "finetune", "NONE", FINE_TUNE, 300, group=None,
               answers="SDXL full fine-tune on one GPU: runs, or how much memory it needed"),
    ]


def phase_sd15_batch(sizes: dict[str, Size]) -> list[Job]:
    size = sizes["sd15"]
    jobs = [_build("sd15", size)]
    for batch in (1, 4):
        for backend in ("NONE", "INDUCTOR"):
            jobs.append(_cell("sd15", size, f"batch{batch}-{backend.lower()}", backend,
                              [f"training.batch_size={batch}"], 240, None,
                              f"batch {batch}: does the ratio to eager hold at small batches",
                              compare_with=f"cell-sd15-batch{batch}-none"))
    return jobs


@dataclass(frozen=True)
class Phase:
    key: str
    minutes: float          # expected minutes on the GPU machine (the budget is 9)
    answers: str
    jobs: Callable[[dict[str, Size]], list[Job]]
    max_parallel: int | None = None   # runs side by side at most (GPU memory), whatever asked


# In order of value; the SD 1.5 GPU issue needs 1-4, the SDXL one 5, the last one 6 and 7.
PHASES: list[Phase] = [
    Phase("1-env", 5, "environment, capabilities, tests/gpu", phase_env),
    Phase("2-sd15", 9, "SD 1.5 LoRA through train.py, every backend, cold, side by side; "
          "saved LoRAs load in diffusers", phase_sd15),
    Phase("3-sd15-warm", 9, "SD 1.5 step times alone on phase 2's cache; channels_last",
          phase_sd15_warm),
    Phase("4-sd15-more", 9, "SD 1.5 full fine-tune eager vs compiled; DEFAULT vs max_autotune",
          phase_sd15_more),
    # Three SDXL runs at 1024 px (~5 GB of weights and ~15 GB of activations each) fit 80 GB.
    Phase("5-sdxl", 9, "SDXL LoRA at 1024 px through train.py, fp16 VAE, LoRA in diffusers",
          phase_sdxl, max_parallel=3),
    Phase("6-rest", 9, "FULL-scope INDUCTOR at SD size; SDXL full fine-tune", phase_rest),
    Phase("7-sd15-batch", 8, "SD 1.5 batch 1 vs 4, eager vs compiled", phase_sd15_batch),
]


def find_phase(name: str) -> Phase:
    """A phase by its key ("2-sd15"), number ("2") or name ("sd15")."""
    for phase in PHASES:
        number, _, label = phase.key.partition("-")
        if name in (phase.key, number, label):
            return phase
    raise ValueError(f"unknown phase {name!r}; phases: {', '.join(p.key for p in PHASES)}")


def phase_jobs(phase: Phase, tiny: bool) -> list[Job]:
    return phase.jobs(TINY_SIZES if tiny else FULL_SIZES)
