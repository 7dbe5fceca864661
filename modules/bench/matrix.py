"""The benchmark matrix: which cells to run, and the training config each cell runs.

A cell is one (backend, components, scope, dynamic) combination. NONE ignores the other three,
so a matrix has exactly one NONE cell: the eager baseline every speedup is divided by.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from modules.config import Config, from_dict, to_dict
from modules.config.outputs import Sampler
from modules.config.schema import (
    BUILTIN_SHAPES,
    CompileBackend,
    CompileScope,
    DatasetConfig,
    DynamicShapes,
)
from modules.model_types import MODEL_TYPES

# --components values -> which compile.* switches they turn on (the UNet is compile.denoiser).
COMPONENT_SETS: dict[str, dict[str, bool]] = {
    "unet": {"denoiser": True, "text_encoder": False, "vae": False},
    "unet+te": {"denoiser": True, "text_encoder": True, "vae": False},
    "all": {"denoiser": True, "text_encoder": True, "vae": True},
}
BASELINE = CompileBackend.NONE.value


@dataclass(frozen=True)
class Cell:
    """One benchmark cell. ``backend`` is kept as text: an unknown name becomes a failed row."""
    backend: str
    components: str
    scope: str
    dynamic: str

    @property
    def is_baseline(self) -> bool:
        return self.backend == BASELINE

    @property
    def cell_id(self) -> str:
        if self.is_baseline:
            return "none"
        safe = self.components.replace("+", "-")
        return f"{self.backend}-{safe}-{self.scope}-{self.dynamic}".lower()

    @property
    def label(self) -> str:
        if self.is_baseline:
            return "NONE (eager)"
        return f"{self.backend} {self.components} {self.scope} {self.dynamic}"


def expand_matrix(backends: Sequence[str], components: Sequence[str], scopes: Sequence[str],
                  dynamic: Sequence[str]) -> list[Cell]:
    """Every combination, NONE once and first (added when missing: speedups need it)."""
    for name in components:
        if name not in COMPONENT_SETS:
            raise ValueError(f"unknown components {name!r}; expected one of "
                             f"{', '.join(COMPONENT_SETS)}")
    for scope in scopes:
        CompileScope(scope)  # ValueError names the bad value
    for dyn in dynamic:
        DynamicShapes(dyn)
    cells = [Cell(BASELINE, components[0], scopes[0], dynamic[0])]
    for backend in backends:
        if backend == BASELINE:
            continue
        for comp in components:
            for scope in scopes:
                for dyn in dynamic:
                    cell = Cell(backend, comp, scope, dyn)
                    if cell not in cells:
                        cells.append(cell)
    return cells


def cell_config(base: Config, cell: Cell, *, max_steps: int, output_dir: Path,
                compile_cache_dir: Path) -> Config:
    """``base`` with the cell's compile settings and a short, quiet, throw-away run.

    Sampling, TensorBoard and periodic saves are off so they never land inside a timed step;
    the compile cache is the cell's own folder so the first run is cold and the second warm.
    Raises ValueError for a backend name torch.compile's table does not have.
    """
    config = from_dict(to_dict(base))
    try:
        backend = CompileBackend(cell.backend)
    except ValueError:
        known = ", ".join(b.value for b in CompileBackend)
        raise ValueError(f"unknown compile backend {cell.backend!r}; known: {known}") from None
    config.compile.backend = backend
    if not cell.is_baseline:
        for name, on in COMPONENT_SETS[cell.components].items():
            setattr(config.compile, name, on)
        config.compile.scope = CompileScope(cell.scope)
        config.compile.dynamic = DynamicShapes(cell.dynamic)
    config.compile.cache_dir = str(compile_cache_dir)
    config.training.max_steps = max_steps
    config.sampling.prompts = []
    config.sampling.every_steps = 0
    config.logging.tensorboard = False
    config.output.dir = str(output_dir)
    config.output.overwrite = True
    config.output.save_every_steps = 0
    return config


def model_config(base: Config, *, model_path: str, model_type, resolution: int, batch: int,
                 method, precision: str | None) -> Config:
    """A config for a benchmark model shape on the built-in shapes dataset.

    The dataset is repeated ``batch`` times so every batch is full: a smaller last batch would
    be a new shape, i.e. a recompile inside the timed steps under STATIC shapes.
    """
    config = from_dict(to_dict(base))
    config.model.path = model_path
    config.model.type = model_type
    config.data.datasets = [DatasetConfig(path=BUILTIN_SHAPES, repeats=batch)]
    config.data.resolution = resolution
    config.training.batch_size = batch
    config.training.method = method
    # A family that samples with its own schedulers only (the family table says which) gets
    # the first of them: the cells never sample, but the config must validate.
    samplers = MODEL_TYPES[model_type].samplers
    if samplers and config.sampling.sampler.value not in samplers:
        config.sampling.sampler = Sampler(samplers[0])
    set_precision(config, precision)
    return config


def default_precision(config: Config) -> str:
    """bf16 where the run will be on CUDA (what SD training uses there; fp32 would leave the
    tensor cores idle and time the wrong thing), fp32 on the CPU (bf16 is emulated slowly)."""
    from modules.train.recipe.builders import pick_device

    return "bf16" if pick_device(config.general.device).type == "cuda" else "fp32"


def set_precision(config: Config, precision: str | None) -> None:
    """fp32 / bf16 / fp16: autocast dtype and the frozen weights' dtype together; None keeps."""
    from modules.config.schema import DType, MixedPrecision

    choices = {"fp32": (MixedPrecision.NO, DType.FLOAT32),
               "bf16": (MixedPrecision.BF16, DType.BFLOAT16),
               "fp16": (MixedPrecision.FP16, DType.FLOAT16)}
    if precision is None:
        return
    if precision not in choices:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(choices)}")
    config.training.mixed_precision, config.model.weight_dtype = choices[precision]
