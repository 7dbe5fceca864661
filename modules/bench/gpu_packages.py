"""What a GPU validation phase needs installed, against what the lent machine's image has and
what each command carries in `.whl/` (``../shared/gpu/README.md`` lists the image,
``../shared/gpu/wheels.sh`` downloads the wheels). A package the image lacks must be carried:
found missing on the GPU machine, it costs a job (or the phase) its scarce minutes. So a job
names the optional packages its settings need, `--list` prints the wheels the next phase needs
besides the default ones, and the runner does not start a job whose package is not installed
(its row says which wheel to carry).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence

# The lent machine's image (distribution names), as ../shared/gpu/README.md lists it. peft is
# there without a recorded version, so it is carried as well (CARRIED).
GPU_IMAGE = frozenset({
    "torch", "triton", "transformers", "accelerate", "huggingface-hub", "safetensors",
    "tokenizers", "numpy", "tensorboard", "matplotlib", "pillow", "tqdm", "torchvision",
    "requests", "pytest", "pytest-timeout", "pytest-xdist", "peft",
})
# What `wheels.sh` downloads with no arguments: every command installs them from .whl/.
CARRIED = {"diffusers": "0.42.1", "peft": "0.21.2"}
# Wheels a phase may need besides those, pinned: `wheels.sh NAME==VERSION` adds one to .whl/.
EXTRA_WHEELS = {"torchao": "0.18.0", "pytorch-optimizer": "4.1.0"}
# What every phase imports on the GPU machine: the engine, the LoRA checks, the CUDA tests.
EVERY_PHASE = ("torch", "triton", "diffusers", "transformers", "peft", "accelerate",
               "safetensors", "tokenizers", "pillow", "tqdm", "matplotlib", "pytest",
               "pytest-timeout")
# Distribution name -> the module it installs, where they differ.
MODULES = {"pytorch-optimizer": "pytorch_optimizer", "pillow": "PIL",
           "pytest-timeout": "pytest_timeout", "huggingface-hub": "huggingface_hub"}


def config_packages(overrides: Sequence[str]) -> list[str]:
    """The optional packages (distribution names) a run with ``overrides`` on the shared
    config needs: 8-bit storage (FLOAT8, INT8) and bf16 stochastic rounding are torchao's, an optimizer is
    its table row's package (modules/config/optimizers.py)."""
    from modules.config import Config, apply_overrides
    from modules.config.optimizers import OPTIMIZERS
    from modules.config.schema import DType

    config = apply_overrides(Config(), list(overrides))
    needed = {OPTIMIZERS[config.training.optimizer].package}
    if config.model.weight_storage.torchao or (
            config.training.fused_backward and config.model.train_dtype == DType.BFLOAT16):
        needed.add("torchao")
    return sorted(name for name in needed if name)


def module_of(package: str) -> str:
    return MODULES.get(package, package.replace("-", "_"))


def missing(packages: Iterable[str]) -> list[str]:
    """The packages of ``packages`` that are not installed here."""
    return [p for p in packages if importlib.util.find_spec(module_of(p)) is None]


def not_carried(packages: Iterable[str]) -> list[str]:
    """The packages neither on the GPU image nor among the wheels a command can carry."""
    return sorted(p for p in set(packages)
                  if p not in GPU_IMAGE and p not in CARRIED and p not in EXTRA_WHEELS)


def extra_wheels(packages: Iterable[str]) -> list[str]:
    """``NAME==VERSION`` of each wheel ``packages`` need besides the default ones (for
    wheels.sh's arguments)."""
    return [f"{p}=={EXTRA_WHEELS[p]}" for p in sorted(set(packages))
            if p in EXTRA_WHEELS and p not in GPU_IMAGE and p not in CARRIED]


def wheels_command(packages: Iterable[str]) -> str:
    """The command (from the project root, here) that puts the wheels ``packages`` need into
    .whl/, to carry to the GPU machine."""
    return " ".join(["bash ../shared/gpu/wheels.sh", *extra_wheels(packages)])
