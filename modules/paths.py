"""Where Tempera keeps what it builds (built-in models, datasets, latent and compile caches) and
what it makes for the user outside a project folder (the demo's outputs)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

# A path field starting with this names the user's data folder (`default_data_dir`): the demo
# preset writes its outputs there, not into the folder Tempera was installed or cloned to.
DATA_PLACEHOLDER = "{data}"


def default_cache_dir() -> Path:
    """The platform cache folder: $XDG_CACHE_HOME/tempera, else ~/.cache/tempera.

    XDG_CACHE_HOME is the freedesktop convention for "where caches go" and only moves the cache;
    the config field `general.cache_dir` overrides it explicitly.
    """
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tempera"


def cache_dir_for(configured: str) -> Path:
    """The cache folder a run uses: the configured one, or the default when empty."""
    return Path(configured) if configured else default_cache_dir()


def compile_cache_folder(compile_cache_dir: str, general_cache_dir: str | Path) -> Path:
    """`compile.cache_dir`, or `<general.cache_dir>/compile` when it is empty (the platform
    cache folder's when that is empty too, never the working folder). Here, not in
    modules.compile, so a front end can say where it is without importing torch."""
    if compile_cache_dir:
        return Path(compile_cache_dir)
    return cache_dir_for(str(general_cache_dir)) / "compile"


def triton_cache_folder(compile_cache: str | Path) -> Path:
    """Where Triton's kernels go for the compile cache folder `compile_cache`: inside it, so a
    cold run (a benchmark cell, a second run in the GUI) never reuses another cache's kernels."""
    return Path(compile_cache) / "triton"


def default_data_dir() -> Path:
    """The platform folder for files a user keeps: $XDG_DATA_HOME/tempera, else
    ~/.local/share/tempera on Linux; %LOCALAPPDATA%/Tempera on Windows; ~/Library/Application
    Support/Tempera on macOS. XDG_DATA_HOME is the freedesktop convention, as for the cache."""
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local") / "Tempera"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "Tempera"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "tempera"


def expand_data_placeholder(value: str) -> str:
    """`{data}/output/demo` → `<the user's data folder>/output/demo`; other values unchanged."""
    if value == DATA_PLACEHOLDER or value.startswith(DATA_PLACEHOLDER + "/"):
        return str(default_data_dir() / value[len(DATA_PLACEHOLDER):].lstrip("/"))
    return value
