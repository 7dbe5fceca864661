"""GUI-only settings (not training settings): UI scale, window size, user presets folder,
the Cloud tab's repository, remote, branch and status location.

Kept in a small JSON file, by default ~/.config/tempera/ui.json; tests pass their own path.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from modules.frontend import atomic_write_text

DEFAULT_SETTINGS_PATH = Path("~/.config/tempera/ui.json")
DEFAULT_USER_PRESETS = "~/.config/tempera/presets"
SCALES = (0.8, 0.9, 1.0, 1.25, 1.5, 1.75, 2.0)


@dataclass
class UISettings:
    scaling: float = 1.0
    geometry: str = "1280x860"
    user_presets_dir: str = DEFAULT_USER_PRESETS
    last_preset: str = ""
    # Cloud tab: where this computer pushes runs and reads their status (never in a config).
    cloud_repo: str = ""
    cloud_remote: str = "origin"
    cloud_branch: str = "main"
    cloud_status: str = ""

    @property
    def user_presets_path(self) -> Path:
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
