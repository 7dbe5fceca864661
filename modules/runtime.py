"""The software a run needs, checked before anything is loaded or written.

Tempera is tested on torch 2.11 (the GPU image, ../shared/gpu/README.md) and 2.13 (the pinned
CPU stack); older releases lack APIs the compile engine uses (``torch.compiler.set_stance``,
dynamo's compile callbacks, ``recompile_limit``) and fail late and obscurely, so they are
refused at the start with the version to install.
"""
from __future__ import annotations

import re

from modules.config.problems import Problem

MIN_TORCH = (2, 11)


def version_tuple(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string like '2.11.0+cu130' or '2.13.0.dev20261101'."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def runtime_problems(torch_version: str | None = None) -> list[Problem]:
    """Problems with the installed software (empty when it is fine to train)."""
    if torch_version is None:
        import torch
        torch_version = torch.__version__
    problems = []
    if version_tuple(torch_version)[:2] < MIN_TORCH:
        problems.append(Problem(
            "torch", f"torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (the oldest release Tempera is "
            "tested with)", torch_version,
            "install a newer torch first: pip install 'torch>=2.11' (see README)"))
    return problems
