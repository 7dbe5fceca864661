"""What this machine and this torch can compile with, checked once before the first step.

`detect_capabilities` looks at the device and the installed torch; `backend_problem` says why a
backend cannot run here (or None). Tests pass their own `Capabilities` instead of detecting.
"""
from __future__ import annotations

import inspect
import os
import shutil
from dataclasses import dataclass, field

import torch

from modules.compile.backends import BACKENDS
from modules.config.schema import CompileBackend

# Triton (and therefore inductor's GPU code generation) needs compute capability 7.0 or newer.
MIN_TRITON_COMPUTE_CAPABILITY = (7, 0)


def torch_compile_keywords() -> frozenset[str]:
    """The keyword arguments the installed ``torch.compile`` accepts.

    They change between releases (``recompile_limit`` arrived in torch 2.12), so the plan asks
    this instead of assuming the newest signature.
    """
    return frozenset(inspect.signature(torch.compile).parameters)


@dataclass(frozen=True)
class Capabilities:
    device_type: str                      # "cpu" or "cuda"
    cuda_available: bool
    compute_capability: tuple[int, int] | None
    triton_ok: bool
    triton_problem: str | None
    cpp_compiler: str | None              # path of the C++ compiler CPU inductor would use
    # keyword arguments of this torch's torch.compile (default: the installed torch's)
    compile_keywords: frozenset[str] = field(default_factory=torch_compile_keywords)

    @classmethod
    def everything(cls, device_type: str = "cuda") -> "Capabilities":
        """A machine on which every backend works (tests that must not degrade), with the
        installed torch's torch.compile."""
        return cls(device_type, True, (9, 0), True, None, "/usr/bin/g++")

    @property
    def per_call_recompile_limit(self) -> bool:
        """Whether ``torch.compile(recompile_limit=...)`` exists (torch >= 2.12)."""
        return "recompile_limit" in self.compile_keywords


def triton_c_compiler() -> str | None:
    """The C compiler Triton would build its GPU launcher with: ``$CC``, else gcc, else clang.

    Triton compiles a small C launcher for every kernel on first use and fails with "Failed to
    find C compiler" when there is none, which would otherwise surface mid-compile.
    """
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen) or (chosen if os.path.isfile(chosen) else None)
    return shutil.which("gcc") or shutil.which("clang")


def _triton_status(device: torch.device) -> tuple[bool, str | None]:
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return False, f"triton is not installed ({err})"
    if device.type != "cuda":
        return False, "triton kernels need a CUDA GPU"
    from torch.utils._triton import has_triton

    if not has_triton():
        return False, "triton is installed but torch reports it unusable on this GPU"
    if triton_c_compiler() is None:
        return False, ("triton needs a C compiler to build its kernel launcher and none was "
                       "found (install gcc, or set CC)")
    return True, None


def _cpp_compiler() -> str | None:
    from torch._inductor import cpp_builder

    try:
        return cpp_builder.get_cpp_compiler()
    # torch raises several exception types for "no compiler found"; the absence is not swallowed:
    # `backend_problem` turns it into a reported degradation of the inductor backends.
    except Exception:
        return None


def detect_capabilities(device: torch.device | str) -> Capabilities:
    """Look at ``device``: CUDA, compute capability, a working triton, a C/C++ compiler."""
    device = torch.device(device)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    capability = torch.cuda.get_device_capability(device) if cuda else None
    triton_ok, triton_problem = _triton_status(device)
    if cuda and capability is not None and capability < MIN_TRITON_COMPUTE_CAPABILITY:
        triton_ok = False
        triton_problem = (f"GPU compute capability {capability[0]}.{capability[1]} is below "
                          f"{MIN_TRITON_COMPUTE_CAPABILITY[0]}.{MIN_TRITON_COMPUTE_CAPABILITY[1]}"
                          " that triton needs")
    return Capabilities(device.type, cuda, capability, triton_ok, triton_problem,
                        _cpp_compiler() if device.type == "cpu" else None)


def backend_problem(backend: CompileBackend, caps: Capabilities) -> str | None:
    """Why ``backend`` cannot run on ``caps`` (None when it can), from its row's needs."""
    row = BACKENDS[backend]
    if not row.compiles or not row.inductor:
        return None  # eager, and dynamo backends with eager kernels, run anywhere
    if row.cuda_only:
        if caps.device_type != "cuda" or not caps.cuda_available:
            return f"{backend.value} needs a CUDA GPU ({row.cuda_only})"
        if not caps.triton_ok:
            return f"{backend.value} needs a working triton: {caps.triton_problem}"
        return None
    # The inductor family generates C++ on the CPU and triton on the GPU.
    if caps.device_type == "cuda":
        if not caps.triton_ok:
            return f"{backend.value} (inductor) on a GPU needs a working triton: {caps.triton_problem}"
        return None
    if not caps.cpp_compiler:
        return f"{backend.value} (inductor) on the CPU needs a C++ compiler; none was found"
    return None
