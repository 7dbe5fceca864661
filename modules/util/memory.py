"""Device memory housekeeping between a failed attempt and its retry."""
from __future__ import annotations

import gc

import torch


def release_device_memory() -> None:
    """Give the GPU memory cached for a failed attempt back before the next attempt.

    PyTorch's caching allocator keeps freed blocks reserved for reuse by this process, so after
    an out-of-memory error while compiling (autotuning) or recording a CUDA graph, the failed
    attempt's blocks stay reserved and the retry on the next backend starts short of memory.
    ``gc.collect()`` comes first: the failed attempt's tensors are only freed once the
    exception's traceback frames and the reference cycles that hold them are collected.
    Call it with no reference to the exception left (see GuardedWindow.run).
    """
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
