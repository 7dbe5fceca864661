"""The persistent compile cache: inductor's FX graph and AOTAutograd caches and Triton's kernels.

A second run with the same config, model and torch finds its compiled kernels in the folder
and skips inductor's code generation (dynamo still traces; that part is not cached).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

# Defined beside the other folders, so a front end can name it without importing torch
from modules.paths import compile_cache_folder, triton_cache_folder  # noqa: F401

# Inductor reads its cache folder from this variable each time it compiles
# (torch/_inductor/runtime/cache_dir_utils.py: cache_dir()); there is no config field for it.
CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
# Triton's kernel cache. Inductor sets it to <its cache folder>/triton/<device> at its first
# GPU kernel when it is unset (torch/_inductor/runtime/triton_heuristics.py) and never again, so
# a second run in the same process (the GUI) with another cache folder would write its Triton
# kernels into the first run's folder unless this is set and restored together with the above.
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def _clear_inductor_path_caches() -> None:
    """Inductor memoises paths derived from its cache folder; forget them when it changes (what
    torch's own ``temporary_cache_dir`` does)."""
    from torch._inductor import utils as inductor_utils

    clear = getattr(inductor_utils, "clear_caches", None)
    if clear is not None:
        clear()


def use_compile_cache(cache_dir: str | Path | None) -> Callable[[], None]:
    """Point inductor's and Triton's on-disk caches at ``cache_dir``; return the undo function.

    Called explicitly by the compile engine when it applies compilation, undone by its
    ``close()``. Environment variables are the only switch torch and Triton offer for these
    folders, and they must stay set while compiles can happen (they are lazy), hence
    set-and-restore instead of a context manager. ``cache_dir`` None or "" turns nothing on
    (the report then says "off").
    """
    if not cache_dir:
        return lambda: None
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    path = Path(cache_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    previous_env = {name: os.environ.get(name) for name in (CACHE_DIR_ENV, TRITON_CACHE_ENV)}
    previous = (inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache)
    os.environ[CACHE_DIR_ENV] = str(path)
    os.environ[TRITON_CACHE_ENV] = str(triton_cache_folder(path))
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    _clear_inductor_path_caches()

    def restore() -> None:
        for name, value in previous_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        inductor_config.fx_graph_cache, functorch_config.enable_autograd_cache = previous
        _clear_inductor_path_caches()

    return restore
