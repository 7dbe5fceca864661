"""The GPU validation's phases, as data: what each runs, in order of value, and its time limits.

A session lent the GPU machine has about 15 minutes of it, a start included, and a machine
starts bare: so each phase is one command of at most 9 minutes that needs nothing from an
earlier one (no compile cache, no model), and a lent session runs the earliest phase without
results. Phases 1, 8, 9, 12 and 14 bring back their ratio first (`_ratio_first`): eager alone,
then one compiled backend cold and alone with whatever the budget has left (less the checks
after it); a cell cut short by that limit stops itself and reports the median of the clean
steps it has. What does not fit behind that is a later phase (10, 11). Phases 2, 5 and 10
train through `scripts/train.py` exactly as a user does, with the compiled runs side by side to
fit their cold starts in one command (their step times share the GPU); phases 3 and 11 compile
side by side first and then time each setting alone on the cache it just filled, so its warm
start and steady step are measured in the same command. Every phase starts with the env job:
the GPU's name, driver and TF32 setting as the runs set it (each phase may be lent another
card). `--tiny` swaps the SD-size random-weight models for the built-in tiny ones and shortens
every run: the CPU suite rehearses every phase that way.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from modules.bench.gpu_context import COMPILED, COMPILED_NAME
from modules.bench.gpu_packages import EVERY_PHASE, config_packages
from modules.bench.gpu_validate import REST, Job


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
    overrides: tuple[str, ...] = ()   # what this model's runs set besides the shared config


# Z-Image samples with the flow-matching Euler scheduler only, and its 4 B text encoder
# leaves the GPU once the captions are cached (as its presets run it).
ZIMAGE_RUNS = ("sampling.sampler=EULER", "data.cache_text_encoder_outputs=true")
# Klein 4B as its LoRA preset trains it (training_presets/klein/lora.json): the same two, LoRA
# on both block types (the single-stream blocks' fused input and output projections too), and
# its LoRA written in the diffusers layout only: the phase measures the step, and the files'
# layouts are tests/models' (the KOHYA file fuses q, k and v on save: time no cell needs)
KLEIN_RUNS = (*ZIMAGE_RUNS, 'training.lora_target_modules=["to_q", "to_k", "to_v", "to_out.0", '
              '"add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "linear_in", '
              '"linear_out", "to_qkv_mlp_proj", "to_out"]', 'output.formats=["DIFFUSERS"]')
FULL_SIZES = {
    "sd15": Size("sd15", "SD15", 512, 2, 20, 10, 8, 10, cell_steps=15),
    "sdxl": Size("sdxl", "SDXL", 1024, 2, 12, 6, 6, 6, cell_steps=10),
    "zimage": Size("zimage", "ZIMAGE", 1024, 1, 8, 4, 4, 8, cell_steps=6,
                   overrides=ZIMAGE_RUNS),
    "klein": Size("klein", "KLEIN", 1024, 1, 8, 4, 4, 8, cell_steps=6, overrides=KLEIN_RUNS),
}
# 192 px: the smallest resolution with a bucket besides the square one (sides are multiples
# of 64), so the rehearsal goes through two buckets too.
TINY_SIZES = {
    "sd15": Size("builtin:tiny-sd15", "SD15", 192, 2, 4, 2, 2, 2, cell_steps=3),
    "sdxl": Size("builtin:tiny-sdxl", "SDXL", 192, 2, 4, 2, 2, 2, cell_steps=3),
    "zimage": Size("builtin:tiny-zimage", "ZIMAGE", 192, 2, 4, 2, 2, 4, cell_steps=3,
                   overrides=ZIMAGE_RUNS),
    "klein": Size("builtin:tiny-klein", "KLEIN", 192, 2, 4, 2, 2, 4, cell_steps=3,
                  overrides=KLEIN_RUNS),
}

# The breadth phase's runs: the backends as the presets run them (REGIONAL, gradient
# checkpointing), and TRITON FULL without checkpointing: the one setting where the plan keeps
# CUDA graphs (with persistent gradients) at SD size. TRITON REGIONAL is not among them: with
# gradient checkpointing the plan turns its CUDA graphs off, so it would be INDUCTOR again.
SD15_TRAIN_RUNS: list[tuple[str, str, list[str]]] = [
    ("none", "NONE", []),
    ("aot_eager", "AOT_EAGER", []),
    ("default", "DEFAULT", []),
    ("inductor", "INDUCTOR", []),
    ("triton-full", "TRITON", ["compile.scope=FULL", "training.gradient_checkpointing=false"]),
]
SDXL_TRAIN_RUNS: list[tuple[str, str, list[str]]] = [
    ("none", "NONE", []),
    ("default", "DEFAULT", []),
    ("inductor", "INDUCTOR", []),
    ("fp16", "NONE", ["training.mixed_precision=FP16", "model.weight_dtype=FLOAT16"]),  # CUDA
    ("triton", "TRITON", []),
]
# A cell started from a compile bundle: warm, so its first step is seconds, not minutes.
BUNDLE_CELL_SECONDS = 150
# A LoRA check's limit, and what a run it checks leaves it of the budget: load a pipeline,
# generate once before and once per saved file.
LORA_SECONDS = 120


# Full fine-tunes save the whole model (the kohya layout is for LoRA files only).
FINE_TUNE = ["training.method=FINE_TUNE", 'output.formats=["DIFFUSERS"]']


def _env() -> Job:
    return Job("env", "env", 90, answers="GPU, driver, versions, TF32 as the runs set it, and "
                                         "what each backend can use")


def _build(key: str, size: Size) -> Job:
    return Job(f"build-{key}", "build", 300 * size.limit_scale,
               {"model": size.model, "model_type": size.model_type,
                "resolution": size.resolution},
               answers="the random-weight model at full architecture, built on this machine "
                       "(on the GPU; on the CPU if that fails, and the row says so)")


def _train(key: str, size: Size, name: str, backend: str, extra: list[str],
           limit: float, group: str | None = "train", answers: str = "",
           reserve: float = 0.0) -> Job:
    # FP16 autocast exists only on CUDA: the CPU rehearsal records such a run as not started.
    needs_cuda = "training.mixed_precision=FP16" in extra
    return Job(f"train-{key}-{name}", "train", limit * size.limit_scale,
               {"size": key, "backend": backend, "overrides": extra, "model": size.model,
                "needs_cuda": needs_cuda,
                "packages": config_packages([*size.overrides, *extra])},
               group=group, after=(f"build-{key}",), reserve_s=reserve,
               answers=answers or f"{backend} trains {key} through train.py: effective backend, "
                                  "compile time, recompiles, memory")


def _lora(key: str, trained: str, group: str | None = "train") -> Job:
    """The LoRA that job ``trained`` (a train run or a cell) saved, into a diffusers pipeline.
    In a group it starts as soon as its run has ended, beside the others."""
    return Job(f"lora-{key}-{trained.split('-', 2)[2]}", "lora", LORA_SECONDS,
               {"size": key, "train_job": trained}, group=group, after=(trained,),
               answers="the saved LoRA loads into a diffusers pipeline and changes its output")


def _cell(key: str, size: Size, name: str, backend: str, extra: list[str], limit: float,
          warm_from: str | None, answers: str, compare_with: str | None = None,
          group: str | None = None, prefix: str = "cell", reserve: float = 0.0) -> Job:
    """A timed cell, alone unless ``group`` is given; ``warm_from``: the job (same phase) whose
    compile cache it starts from, and must have ended ok; ``compare_with``: the cell (same
    phase) its speed-up is against (default: eager; "": none). Cells side by side share the
    GPU, so their step times are never compared: their memory peaks (per process) still hold."""
    baseline = None if name == "none" or group else (
        f"cell-{key}-none" if compare_with is None else compare_with or None)
    return Job(f"{prefix}-{key}-{name}", "cell", limit * size.limit_scale,
               {"size": key, "backend": backend, "overrides": extra, "model": size.model,
                "warm_from": warm_from, "compare_with": baseline,
                "packages": config_packages([*size.overrides, *extra])},
               group=group, after=(f"build-{key}",) + ((warm_from,) if warm_from else ()),
               answers=answers, reserve_s=reserve)


def _bundle_cell(key: str, size: Size, name: str, backend: str, written_by: str,
                 limit: float, answers: str) -> Job:
    """A timed cell on an empty compile cache folder that starts from the compile bundle the
    cell ``written_by`` (same phase) wrote, alone: a new machine's first step."""
    job = _cell(key, size, name, backend, [], limit, None, answers, prefix="bundle")
    job.spec["bundle_from"] = written_by
    return dataclasses.replace(job, after=(*job.after, written_by))


def _cold(key: str, size: Size, name: str, backend: str, extra: list[str], limit: float,
          reserve: float = 0.0) -> Job:
    """The cold start of a cell, side by side with the other backends' (group "cold"): it
    fills the compile cache that ``cell-KEY-NAME`` then starts from, alone. Its compile
    seconds are an upper bound (the CPU was shared)."""
    return _cell(key, size, name, backend, extra, limit, None, "the cold compile, side by "
                 "side, that the cell alone then starts warm from", group="cold", prefix="cold",
                 reserve=reserve)


def _ratio_first(key: str, size: Size, eager: tuple[str, list[str], float, str],
                 compiled: tuple[str, str, list[str], str], reserve: float = 0.0,
                 eager_against: str = "") -> list[Job]:
    """A phase's ratio, first: its eager cell alone (``eager``: name, overrides, limit,
    answers; compared with the cell ``eager_against`` if given), then one compiled cell
    (``compiled``: name, backend, overrides, answers) cold and alone with whatever the budget
    has left less ``reserve`` (the checks after it), compared with that eager cell. A compile
    that leaves it too little time for all its clean steps stops itself with those it has: a
    ratio from a short steady window beats none."""
    eager_name, eager_extra, eager_limit, eager_answers = eager
    name, backend, extra, answers = compiled
    return [_cell(key, size, eager_name, "NONE", eager_extra, eager_limit, None, eager_answers,
                  compare_with=eager_against),
            _cell(key, size, name, backend, extra, REST, None, answers,
                  compare_with=f"cell-{key}-{eager_name}", reserve=reserve)]




def phase_sd15_headline(sizes: dict[str, Size]) -> list[Job]:
    """The number the product is about, first: eager alone, then DEFAULT cold and alone with
    every core and whatever the budget leaves after its LoRA check (no max_autotune: the most
    likely to finish; the cell's median leaves its compile steps out, and a cold start that
    runs long still leaves a partial window's median), its LoRA in diffusers, then INDUCTOR
    (max_autotune) alone with what is left: its ratio, or how long its cold start ran alone."""
    size = sizes["sd15"]
    return [
        _env(), _build("sd15", size),
        *_ratio_first("sd15", size, ("none", [], 150, "eager's steady step time and memory, "
                                                     "alone: the baseline"),
                      ("default", "DEFAULT", [], "DEFAULT (inductor, no max_autotune) cold and "
                       "alone: its speed-up over eager"), reserve=LORA_SECONDS),
        _lora("sd15", "cell-sd15-default", group=None),
        _cell("sd15", size, "inductor", "INDUCTOR", [], REST, None,
              "INDUCTOR (max_autotune) cold and alone with what is left: its speed-up, or how "
              "long its cold start ran"),
    ]


def phase_bundle(sizes: dict[str, Size]) -> list[Job]:
    """Compile bundles at SD 1.5 size: REGIONAL DEFAULT (inductor) cold and alone (it writes the
    bundle), then the same settings alone in a fresh process on an empty cache folder that has
    only that bundle (a new machine's or a cloud run's start): the first step's seconds of
    each against eager's (target: the bundle's first step within 10 s of eager's)."""
    size = sizes["sd15"]
    return [_env(), _build("sd15", size),
            _cell("sd15", size, "none", "NONE", [], 150, None,
                  "eager's first step and steady step, alone: the baseline"),
            _cell("sd15", size, COMPILED_NAME, COMPILED, [], REST, None,
                  f"REGIONAL {COMPILED} cold and alone: its first step, and the bundle it "
                  "writes", reserve=BUNDLE_CELL_SECONDS),
            _bundle_cell("sd15", size, COMPILED_NAME, COMPILED, f"cell-sd15-{COMPILED_NAME}",
                         BUNDLE_CELL_SECONDS, "the same settings on an empty cache folder with "
                         "only that bundle: its first step against eager's and the cold one")]


def phase_sd15_breadth(sizes: dict[str, Size]) -> list[Job]:
    """Every backend through train.py side by side, each run with what the budget has left
    less its LoRA check; the CUDA tests in the slot the eager run frees."""
    size = sizes["sd15"]
    jobs = [_env(), _build("sd15", size)]
    jobs += [_train("sd15", size, name, backend, extra, REST, reserve=LORA_SECONDS)
             for name, backend, extra in SD15_TRAIN_RUNS]
    # It too leaves the LoRA checks their time (and its slot once the runs end).
    jobs.append(Job("tests-gpu", "pytest", REST,
                    {"paths": ["tests/gpu", "tests/bench/test_benchmark_cuda.py"],
                     "per_test": 300}, group="train", reserve_s=LORA_SECONDS,
                    answers="the CUDA-only tests (tests/gpu and the CUDA benchmark test)"))
    # A compiled run's LoRA too: a compile wrapper's names must not leak into the saved keys.
    # DEFAULT's, not INDUCTOR's: a max_autotune run is the likeliest to be killed, and its
    # check with it.
    jobs += [_lora("sd15", f"train-sd15-{run}") for run in ("default", "aot_eager", "none")]
    return jobs


# The warm phase's compiled settings, in order of value: what the cells alone time, warm.
SD15_WARM = [(name, backend, extra) for name, backend, extra in SD15_TRAIN_RUNS
             if backend not in ("NONE", "AOT_EAGER")]   # AOT_EAGER: a debugging backend
SD15_WARM.sort(key=lambda run: ["default", "inductor", "triton-full"].index(run[0]))


def phase_sd15_warm(sizes: dict[str, Size]) -> list[Job]:
    size = sizes["sd15"]
    jobs = [_env(), _build("sd15", size)]
    jobs += [_cold("sd15", size, name, backend, extra, 300) for name, backend, extra in SD15_WARM]
    jobs.append(_cell("sd15", size, "none", "NONE", [], 120, None,
                      "eager's steady step time and memory, alone: the baseline"))
    jobs += [_cell("sd15", size, name, backend, extra, 120, f"cold-sd15-{name}",
                   "steady step time, ratio to eager, warm first step, memory, alone")
             for name, backend, extra in SD15_WARM]
    for name, backend in (("channels-last-none", "NONE"),
                          (f"channels-last-{COMPILED_NAME}", COMPILED)):
        jobs.append(_cell("sd15", size, name, backend, ["training.channels_last=true"], 240,
                          None, "does channels_last pay (against the same backend without)",
                          compare_with=f"cell-sd15-{backend.lower()}"))
    return jobs


def phase_sd15_more(sizes: dict[str, Size]) -> list[Job]:
    size = sizes["sd15"]
    jobs = [_env(), _build("sd15", size)]
    # Side by side: the question is memory (each process's own peaks), not speed.
    for backend in ("NONE", COMPILED):
        jobs.append(_cell("sd15", size, f"finetune-{backend.lower()}", backend,
                          FINE_TUNE, 300, None,
                          "full fine-tune: peak memory, eager vs compiled", group="finetune"))
    # Last: max_autotune's cold start may not fit at all (public figures: 4-25 min at SD
    # size); then its row says how long it ran, which answers the question too.
    jobs += [_cell("sd15", size, "default", "DEFAULT", [], 240, None,
                   "DEFAULT, cold: what max_autotune is against", compare_with=""),
             _cell("sd15", size, "inductor-autotune", "INDUCTOR", ["compile.mode=MAX_AUTOTUNE"],
                   480, None, "is max_autotune's cold start worth its step time at SD size",
                   compare_with="cell-sd15-default")]
    return jobs


def phase_sdxl(sizes: dict[str, Size]) -> list[Job]:
    size = sizes["sdxl"]
    jobs = [_env(), _build("sdxl", size)]
    jobs += [_train("sdxl", size, name, backend, ["data.cache_text_encoder_outputs=true", *extra],
                    REST, reserve=LORA_SECONDS,
                    answers=f"{backend} trains SDXL at {size.resolution} px"
                    + (" in fp16: the VAE gives finite latents" if name == "fp16" else ""))
             for name, backend, extra in SDXL_TRAIN_RUNS]
    jobs += [_lora("sdxl", f"train-sdxl-{run}") for run in ("default", "none")]
    return jobs


ZIMAGE_EAGER_SECONDS = 180   # the 12 GB transformer's load, the captions cached, 6 steps


def phase_zimage(sizes: dict[str, Size]) -> list[Job]:
    """Z-Image at 1024 px, built on the GPU: its ratio first, eager alone, then REGIONAL
    DEFAULT cold and alone with what is left (a partial window's median if its cold start
    runs long). Its runs through train.py are a later phase's (`phase_zimage_train`)."""
    size = sizes["zimage"]
    return [_env(), _build("zimage", size),
            *_ratio_first("zimage", size, ("none", [], ZIMAGE_EAGER_SECONDS,
                                           "eager's steady Z-Image step and memory, alone: "
                                           "the baseline"),
                          (COMPILED_NAME, COMPILED, [], f"REGIONAL {COMPILED} cold and alone "
                           "with what is left: cold start, steady step against eager, memory"))]


KLEIN_EAGER_SECONDS = 150    # the 8 GB transformer's load, the captions cached, 6 steps


def phase_klein(sizes: dict[str, Size]) -> list[Job]:
    """Flux.2 Klein 4B LoRA at 1024 px, built on the GPU: its ratio first, eager alone, then
    REGIONAL DEFAULT (inductor over both block types) cold and alone with what is left (a
    partial window's median if its cold start runs long). Its measured cold compile is what
    the ETA's compile share for Klein waits for."""
    size = sizes["klein"]
    return [_env(), _build("klein", size),
            *_ratio_first("klein", size, ("none", [], KLEIN_EAGER_SECONDS,
                                          "eager's steady Klein 4B step and memory, alone: "
                                          "the baseline"),
                          (COMPILED_NAME, COMPILED, [], f"REGIONAL {COMPILED} over both block "
                           "types, cold and alone with what is left: cold start, steady step "
                           "against eager, memory"))]


def phase_zimage_train(sizes: dict[str, Size]) -> list[Job]:
    """Z-Image through train.py as a user runs it: eager and REGIONAL DEFAULT side by side,
    cold, each with what the budget has left (compile seconds, recompiles after the first
    pass with sampling, both memory peaks beside the plan)."""
    size = sizes["zimage"]
    jobs = [_env(), _build("zimage", size)]
    jobs += [_train("zimage", size, name, backend, [], REST,
                    answers=f"{backend} trains Z-Image at {size.resolution} px through "
                            "train.py, cold: compile time, recompiles, peak memory vs the plan")
             for name, backend in (("none", "NONE"), (COMPILED_NAME, COMPILED))]
    return jobs


def phase_rest(sizes: dict[str, Size]) -> list[Job]:
    """Each run alone. FULL last: its cold start may outlast what is left, and then its row
    says how long it ran, which answers the question too."""
    sd15, sdxl = sizes["sd15"], sizes["sdxl"]
    return [
        _env(), _build("sdxl", sdxl),
        _train("sdxl", sdxl, "finetune", "NONE", FINE_TUNE, 300, group=None,
               answers="SDXL full fine-tune on one GPU: runs, or refuses up front with the "
                       "memory it needs"),
        _build("sd15", sd15),
        _train("sd15", sd15, f"{COMPILED_NAME}-alone", COMPILED, [], 240, group=None,
               answers=f"REGIONAL {COMPILED} at SD size, alone: what FULL is against"),
        _train("sd15", sd15, f"{COMPILED_NAME}-full", COMPILED,
               ["compile.scope=FULL", "training.gradient_checkpointing=false"], 480, group=None,
               answers=f"FULL-scope {COMPILED} at SD size: cold start and speed against "
                       "REGIONAL"),
    ]


def phase_sd15_batch(sizes: dict[str, Size]) -> list[Job]:
    size = sizes["sd15"]
    jobs = [_env(), _build("sd15", size)]
    for batch in (1, 4):
        for backend in ("NONE", COMPILED):
            jobs.append(_cell("sd15", size, f"batch{batch}-{backend.lower()}", backend,
                              [f"training.batch_size={batch}"], 240, None,
                              f"batch {batch}: does the ratio to eager hold at small batches",
                              compare_with=f"cell-sd15-batch{batch}-none"
                              if backend != "NONE" else ""))
    return jobs


# Block offload (docs/memory.md): every UNet block streamed, the frozen weights at bfloat16 so
# the saving holds through the step (autocast would keep 16-bit copies of float32 weights).
OFFLOAD = ["model.offload_blocks=1000", "model.weight_dtype=BFLOAT16"]
BF16_FROZEN = ["model.weight_dtype=BFLOAT16"]


LEVER_EAGER_SECONDS = 100    # an SDXL cell alone, eager: load, latents, 10 steps
OFFLOAD_WARM_SECONDS = 90    # an SDXL cell alone, warm: load, the cache's kernels, 10 steps


def _lever_ratio_first(sizes: dict[str, Size], lever: str, extra: list[str],
                       what: str) -> list[Job]:
    """A memory lever at SDXL size (the card sizes levers are for), each cell alone. Its ratio
    first, without a compile: eager with ``what`` (``extra``) against eager with bf16 frozen
    weights alone (the peak memory it saves, the step time it costs); then REGIONAL DEFAULT
    with it, cold and alone with what is left, against eager with it."""
    size = sizes["sdxl"]
    return [_env(), _build("sdxl", size),
            _cell("sdxl", size, f"{lever}-base-none", "NONE", BF16_FROZEN, LEVER_EAGER_SECONDS,
                  None, f"eager with bf16 frozen weights: what {what} is against",
                  compare_with=""),
            *_ratio_first("sdxl", size, (f"{lever}-none", extra, LEVER_EAGER_SECONDS,
                                         f"eager with {what}: step time and peak memory "
                                         "against the same run without"),
                          (f"{lever}-{COMPILED_NAME}", COMPILED, extra, f"REGIONAL {COMPILED} "
                           f"with {what}, cold and alone with what is left: does compiling still "
                           "pay with it"), eager_against=f"cell-sdxl-{lever}-base-none")]


# The 8-bit levers of the cards most users own (RTX 30 / 40: int8 tensor cores, no float8 before
# sm_89): int8 frozen weights (torchao, carried) and W8A8's int8 matmuls (torch alone)
INT8 = ["model.weight_storage=INT8", "model.weight_dtype=BFLOAT16"]
W8A8 = ["model.weight_storage=W8A8", "model.weight_dtype=BFLOAT16"]


def phase_int8(sizes: dict[str, Size]) -> list[Job]:
    """INT8 storage and W8A8 at SDXL size, each cell alone, eager first: bf16 frozen weights,
    INT8, W8A8 (the peak memory each saves, the step time each costs or gains: W8A8's int8
    matmuls are for speed); then REGIONAL DEFAULT with W8A8, cold and alone with what is
    left, against eager with it (do its int8 kernels still pay inside compiled blocks)."""
    base, *rest = _lever_ratio_first(sizes, "w8a8", W8A8, "int8 matmuls (W8A8)")[2:]
    int8 = _cell("sdxl", sizes["sdxl"], "int8-none", "NONE", INT8, LEVER_EAGER_SECONDS, None,
                 "eager with int8 frozen weights (INT8 storage): step time and peak memory "
                 "against the same run without", compare_with="cell-sdxl-w8a8-base-none")
    return [_env(), _build("sdxl", sizes["sdxl"]), base, int8, *rest]


def phase_offload(sizes: dict[str, Size]) -> list[Job]:
    """Block offload: what only a GPU shows is the step time it costs where the copies do not
    hide behind compute, and the peak memory it saves. DEFAULT with against without offload
    is a later phase's (`phase_offload_inductor`): two SDXL cold compiles do not fit one
    command."""
    *first, compiled = _lever_ratio_first(sizes, "offload", OFFLOAD, "every block offloaded")
    # the two levers together (the Klein 9B 16 GB preset's): int8 blocks streamed, eager
    both = _cell("sdxl", sizes["sdxl"], "offload-int8-none", "NONE",
                 [*OFFLOAD, "model.weight_storage=INT8"], LEVER_EAGER_SECONDS, None,
                 "eager with every block offloaded and stored in int8: step time and peak "
                 "memory against bf16 frozen weights (the torchao tensors' streaming on CUDA)",
                 compare_with="cell-sdxl-offload-base-none")
    return [*first, both, compiled]


# A full fine-tune with the fused backward (each weight stepped in backward), the frozen-less
# blocks' weights at bf16: with block offload their weights, gradients and optimizer state
# live on the host and step there (train/memory/offload_trained.py)
FUSED_FINE_TUNE = [*FINE_TUNE, "training.fused_backward=true", "model.weight_dtype=BFLOAT16",
                   "model.train_dtype=FLOAT32"]


def phase_offload_fine_tune(sizes: dict[str, Size]) -> list[Job]:
    """Block offload for a full fine-tune at SDXL size, eager, each cell alone: the fused
    fine-tune without offload, then with every block's weights, gradients and optimizer state
    on the host (the host's optimizer steps them): the peak memory it saves against the memory
    plan's offload line, and the step time the host steps and copies cost."""
    size = sizes["sdxl"]
    return [_env(), _build("sdxl", size),
            _cell("sdxl", size, "ft-base-none", "NONE", FUSED_FINE_TUNE, 2 * LEVER_EAGER_SECONDS,
                  None, "a fused full fine-tune, eager: what offload is against",
                  compare_with=""),
            _cell("sdxl", size, "ft-offload-none", "NONE",
                  [*FUSED_FINE_TUNE, "model.offload_blocks=1000"], 3 * LEVER_EAGER_SECONDS,
                  None, "the same with every block offloaded (weights, gradients and optimizer "
                  "state on the host): step time and peak memory against it",
                  compare_with="cell-sdxl-ft-base-none")]


def phase_offload_inductor(sizes: dict[str, Size]) -> list[Job]:
    """REGIONAL DEFAULT at SDXL size with every block offloaded and without: both cold
    starts side by side (each with what is left less the warm cells' time), then each alone,
    warm on the cache its cold twin filled: the step time offload costs a compiled step."""
    size = sizes["sdxl"]
    runs = [(f"offload-base-{COMPILED_NAME}", BF16_FROZEN), (f"offload-{COMPILED_NAME}", OFFLOAD)]
    jobs = [_env(), _build("sdxl", size)]
    jobs += [_cold("sdxl", size, name, COMPILED, extra, REST,
                   reserve=len(runs) * OFFLOAD_WARM_SECONDS) for name, extra in runs]
    jobs += [_cell("sdxl", size, name, COMPILED, extra, OFFLOAD_WARM_SECONDS,
                   f"cold-sdxl-{name}", f"{COMPILED} alone, warm: step time and peak memory, "
                   + ("with every block offloaded, against the same without" if extra == OFFLOAD
                      else "bf16 frozen weights: what offload is against"),
                   compare_with=f"cell-sdxl-offload-base-{COMPILED_NAME}" if extra == OFFLOAD
                   else "")
             for name, extra in runs]
    return jobs


# Float8 storage (docs/memory.md): the frozen linear weights as float8 through torchao, the rest
# at bfloat16.
FLOAT8 = ["model.weight_storage=FLOAT8", "model.weight_dtype=BFLOAT16"]


def phase_float8(sizes: dict[str, Size]) -> list[Job]:
    """Float8 weight storage: the memory it saves and what its dequantizing costs, eager and
    fused into DEFAULT's compiled blocks. Needs torchao: `--list` names its wheel."""
    return _lever_ratio_first(sizes, "float8", FLOAT8, "float8 frozen weights")


@dataclass(frozen=True)
class Phase:
    key: str
    minutes: float          # expected minutes on the GPU machine (the budget is 9)
    answers: str            # what it measures, as --list prints it
    topic: str              # what its results are about (a model, a lever), for --list
    jobs: Callable[[dict[str, Size]], list[Job]]
    max_parallel: int | None = None   # runs side by side at most (GPU memory), whatever asked


# In order of value: one per lent session, the earliest without results first. The keys of
# phases whose results may already be merged into benchmarks.md stay as they are: a later
# phase is added at the end.
PHASES: list[Phase] = [
    Phase("1-sd15-headline", 9, "SD 1.5 LoRA: eager alone, then DEFAULT cold and alone with "
          "what the budget leaves (its speed-up) and its LoRA in diffusers; INDUCTOR alone "
          "with what is left", "SD 1.5", phase_sd15_headline),
    # Five runs, the CUDA tests in the eager run's slot once it ends.
    Phase("2-sd15-breadth", 9, "SD 1.5 LoRA through train.py, every backend, cold, side by "
          "side; saved LoRAs load in diffusers; tests/gpu", "SD 1.5", phase_sd15_breadth,
          max_parallel=5),
    Phase("3-sd15-warm", 9, "SD 1.5 step times alone, warm on the cache compiled side by side "
          "first; channels_last", "SD 1.5", phase_sd15_warm),
    Phase("4-sd15-more", 9, "SD 1.5 full fine-tune eager vs compiled; DEFAULT vs max_autotune",
          "SD 1.5", phase_sd15_more),
    # Three SDXL runs at 1024 px (~5 GB of weights and ~15 GB of activations each) fit 80 GB.
    Phase("5-sdxl", 9, "SDXL LoRA at 1024 px through train.py, fp16 VAE, LoRA in diffusers",
          "SDXL", phase_sdxl, max_parallel=3),
    Phase("6-rest", 9, "FULL-scope DEFAULT at SD size; SDXL full fine-tune",
          "at size", phase_rest),
    Phase("7-sd15-batch", 8, "SD 1.5 batch 1 vs 4, eager vs compiled", "at size",
          phase_sd15_batch),
    Phase("8-zimage", 9, "Z-Image at 1024 px: eager alone, then REGIONAL DEFAULT cold and "
          "alone with what is left: its speed-up and memory", "Z-Image", phase_zimage),
    # A memory lever, not a headline number.
    Phase("9-offload", 9, "SDXL LoRA with every UNet block offloaded vs not, eager, each alone "
          "(step time and peak memory); offloaded int8 blocks, eager; then REGIONAL DEFAULT "
          "offloaded, cold and alone with what is left", "memory levers", phase_offload),
    # Two runs of a 6 B transformer at 1024 px side by side (12 GB of bf16 weights each, the
    # text encoder's 8 GB only while captions are cached) fit 80 GB.
    Phase("10-zimage-train", 9, "Z-Image at 1024 px through train.py, eager and REGIONAL "
          "DEFAULT side by side, cold: compile seconds, recompiles, memory peaks against the "
          "plan", "Z-Image", phase_zimage_train, max_parallel=2),
    Phase("11-offload-inductor", 9, "SDXL LoRA, REGIONAL DEFAULT with every block offloaded "
          "vs not: cold side by side, then each alone warm (step time and peak memory)",
          "memory levers", phase_offload_inductor),
    Phase("12-float8", 9, "SDXL LoRA with float8 frozen weights vs bf16, eager, each alone "
          "(step time and peak memory); then REGIONAL DEFAULT with float8, cold and alone with "
          "what is left", "memory levers", phase_float8),
    Phase("13-bundle", 9, "SD 1.5 LoRA, REGIONAL DEFAULT: the first step cold, then in a "
          "fresh process and cache folder from the compile bundle alone, against eager's",
          "compile bundles", phase_bundle),
    Phase("14-klein", 9, "Flux.2 Klein 4B LoRA at 1024 px: eager alone, then REGIONAL DEFAULT "
          "over both block types cold and alone with what is left: its speed-up and memory",
          "Flux.2 Klein", phase_klein),
    Phase("15-int8", 9, "SDXL LoRA with int8 frozen weights (INT8) and int8 matmuls (W8A8) vs "
          "bf16, eager, each alone (step time and peak memory); then REGIONAL DEFAULT with W8A8, "
          "cold and alone with what is left", "memory levers", phase_int8),
    Phase("16-offload-fine-tune", 9, "SDXL full fine-tune (fused backward) with every block's "
          "weights, gradients and optimizer state on the host vs not, eager, each alone (step "
          "time and peak memory)", "memory levers", phase_offload_fine_tune),
]


def find_phase(name: str) -> Phase:
    """A phase by its key ("1-sd15-headline"), number ("1") or name ("sd15-headline")."""
    for phase in PHASES:
        number, _, label = phase.key.partition("-")
        if name in (phase.key, number, label):
            return phase
    raise ValueError(f"unknown phase {name!r}; phases: {', '.join(p.key for p in PHASES)}")


def phase_jobs(phase: Phase, tiny: bool) -> list[Job]:
    return phase.jobs(TINY_SIZES if tiny else FULL_SIZES)


def phase_packages(phase: Phase) -> list[str]:
    """Every package (distribution name) the phase imports on the GPU machine: the engine's,
    and what its runs' settings need (at full size: what the GPU machine runs)."""
    needed = set(EVERY_PHASE)
    for job in phase_jobs(phase, tiny=False):
        needed.update(job.spec.get("packages", ()))
    return sorted(needed)


def measured_table(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """The cold compile times of merged GPU phases (their summary.json data), as
    `modules.compile.measured` reads them: each job's size and overrides from this plan."""
    from modules.compile.measured import table_rows
    from modules.model_types import MODEL_TYPES
    labels = {kind.value: spec.label for kind, spec in MODEL_TYPES.items()}
    return {"written_by": "scripts/gpu_validate.py merge (from docs/benchmarks/gpu/)",
            "rows": table_rows(phases, lambda key: phase_jobs(find_phase(key), tiny=False),
                               FULL_SIZES, labels)}
