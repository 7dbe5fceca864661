"""The persistent compile cache: inductor's FX graph cache and AOTAutograd cache in one folder.

A second run with the same config, model and torch finds its compiled kernels there and skips
inductor's code generation (dynamo still traces; that part is not cached by default).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# Inductor reads its cache folder from this variable each time it compiles
# (torch/_inductor/runtime/cache_dir_utils.py: cache_dir()); there is no config field for it.
CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_compile_cache(cache_dir: str | Path | None) -> Callable[[], None]:
    """Point inductor's on-disk caches at ``cache_dir`` and return a function that undoes it.

    Called explicitly by the compile engine when it applies compilation, undone by its
    ``close()``. An environment variable is the only switch torch offers for the folder, and it
    must stay set while compiles can happen (they are lazy), hence set-and-restore instead of a
    context manager. ``cache_dir`` None or "" turns nothing on (the report then says "off").
    """
    if not cache_dir:
        return lambda: None
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    path = Path(cache_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    previous_env = os.environ.get(CACHE_DIR_ENV)
    previous = (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache)
    os.environ[CACHE_DIR_ENV] = str(path)
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True

    def restore() -> None:
        if previous_env is None:
            os.environ.pop(CACHE_DIR_ENV, None)
        else:
            os.environ[CACHE_DIR_ENV] = previous_env
        inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = previous

    return restore


def save_portable_cache(path: str | Path) -> bool:
    """Write this process's compile artifacts to one file (``torch.compiler.save_cache_artifacts``).

    For moving a warm cache to another machine with the same torch and GPU (cloud runs).
    Returns False when there was nothing to save.
    """
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    Path(path).write_bytes(saved[0])
    return True


def load_portable_cache(path: str | Path) -> bool:
    """Load a file written by `save_portable_cache` into the local caches; False if none."""
    import torch

    path = Path(path)
    if not path.is_file():
        return False
    return torch.compiler.load_cache_artifacts(path.read_bytes()) is not None
