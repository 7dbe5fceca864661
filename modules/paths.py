"""Where Tempera keeps what it builds (built-in models, datasets, latent and compile caches)."""
from __future__ import annotations

import os
from pathlib import Path


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
