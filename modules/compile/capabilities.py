"""What this machine can compile with, checked once before the first step.

`detect_capabilities` looks at the device; `backend_problem` says why a backend cannot run
here (or None). Tests pass their own `Capabilities` instead of detecting.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from modules.config.schema import CompileBackend

# Triton (and therefore inductor's GPU code generation) needs compute capability 7.0 or newer.
MIN_TRITON_COMPUTE_CAPABILITY = (7, 0)


@dataclass(frozen=True)
class Capabilities:
    device_type: str                      # "cpu" or "cuda"
    cuda_available: bool
    compute_capability: tuple[int, int] | None
    triton_ok: bool
    triton_problem: str | None
    cpp_compiler: str | None              # path of the C++ compiler CPU inductor would use

    @classmethod
    def everything(cls, device_type: str = "cuda") -> "Capabilities":
        """A machine on which every backend works (tests that must not degrade)."""
        return cls(device_type, True, (9, 0), True, None, "/usr/bin/g++")


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
    """Look at ``device``: CUDA, compute capability, a working triton, a C++ compiler."""
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
    """Why ``backend`` cannot run on ``caps`` (None when it can)."""
    if backend in (CompileBackend.NONE, CompileBackend.AOT_EAGER):
        return None
    if backend == CompileBackend.TRITON:
        if caps.device_type != "cuda" or not caps.cuda_available:
            return "TRITON needs a CUDA GPU (CUDA graphs do not exist on the CPU)"
        if not caps.triton_ok:
            return f"TRITON needs a working triton: {caps.triton_problem}"
        return None
    # DEFAULT and INDUCTOR: inductor generates C++ on the CPU and triton on the GPU.
    if caps.device_type == "cuda":
        if not caps.triton_ok:
            return f"{backend.value} (inductor) on a GPU needs a working triton: {caps.triton_problem}"
        return None
    if not caps.cpp_compiler:
        return f"{backend.value} (inductor) on the CPU needs a C++ compiler; none was found"
    return None
