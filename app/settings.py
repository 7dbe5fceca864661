"""GUI-only settings (not training settings): UI scale, window size, user presets folder,
the Cloud tab's repository, remote, branch and status location.

Kept in a small JSON file in the user's config folder (`config_dir`: $XDG_CONFIG_HOME/tempera,
else ~/.config/tempera), ui.json; tests pass their own path.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from modules.frontend import atomic_write_text

SCALES = (0.8, 0.9, 1.0, 1.25, 1.5, 1.75, 2.0)


def config_dir() -> Path:
    """The user's config folder for Tempera: $XDG_CONFIG_HOME/tempera, else ~/.config/tempera.
    XDG_CONFIG_HOME is the freedesktop convention for where settings go (as XDG_CACHE_HOME and
    XDG_DATA_HOME are for the cache and data folders, modules/paths.py); it only moves them."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "tempera"


def default_settings_path() -> Path:
    """Where the window keeps its settings when not told otherwise (`--settings`)."""
    return config_dir() / "ui.json"


@dataclass
class UISettings:
    scaling: float = 1.0
    geometry: str = "1280x860"
    user_presets_dir: str = ""  # empty: the presets folder in the config folder
    last_preset: str = ""
    # Cloud tab: where this computer pushes runs and reads their status (never in a config).
    cloud_repo: str = ""
    cloud_remote: str = "origin"
    cloud_branch: str = "main"
    cloud_status: str = ""

    @property
    def user_presets_path(self) -> Path:
        if not self.user_presets_dir:
            return config_dir() / "presets"
        return Path(self.user_presets_dir).expanduser()


def load_settings(path: Path) -> tuple[UISettings, str | None]:
    """The settings in `path` (defaults when missing) and a warning when the file was unusable."""
    path = Path(path).expanduser()
    if not path.exists():
        return UISettings(), None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        known = {f.name for f in fields(UISettings)}
        settings = UISettings(**{k: v for k, v in data.items() if k in known})
        if settings.scaling not in SCALES:
            settings.scaling = 1.0
        return settings, None
    except (OSError, ValueError, TypeError) as exc:
        return UISettings(), f"ignored unreadable GUI settings {path}: {exc}"


def save_settings(settings: UISettings, path: Path) -> None:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(asdict(settings), indent=2) + "\n")
