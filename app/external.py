"""Opening folders and starting TensorBoard: the only places the GUI starts other programs."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path


def folder_opener() -> list[str] | None:
    """The command that opens a folder in the desktop's file manager (None on Windows)."""
    if sys.platform.startswith("win"):
        return None
    return ["open"] if sys.platform == "darwin" else ["xdg-open"]


def open_folder(path: Path) -> None:
    """Open `path` in the file manager; raises OSError (with the reason) when that is impossible."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"the folder {path} does not exist yet")
    opener = folder_opener()
    if opener is None:  # Windows (folder_opener), the one platform with os.startfile
        if sys.platform.startswith("win"):
            os.startfile(str(path))
        return
    if shutil.which(opener[0]) is None:
        raise FileNotFoundError(f"'{opener[0]}' is not installed; open {path} yourself")
    subprocess.Popen([*opener, str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def open_url(url: str) -> None:
    """Open `url` in the desktop's browser (nothing happens where there is none)."""
    import webbrowser
    webbrowser.open(url)


TENSORBOARD_PORT = 6006  # TensorBoard's own default


def tensorboard_command(logdir: Path) -> list[str] | None:
    """The command that serves `logdir` on 127.0.0.1:6006, or None when TensorBoard is not
    installed."""
    args = ["--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(TENSORBOARD_PORT)]
    beside_python = Path(sys.executable).parent / "tensorboard"
    exe = shutil.which("tensorboard") or (str(beside_python) if beside_python.exists() else None)
    if exe:
        return [exe, *args]
    if importlib.util.find_spec("tensorboard") is not None:
        return [sys.executable, "-m", "tensorboard.main", *args]
    return None


def start_tensorboard(logdir: Path) -> subprocess.Popen:
    """Start TensorBoard in the background; raises FileNotFoundError when it is not installed."""
    command = tensorboard_command(logdir)
    if command is None:
        raise FileNotFoundError("TensorBoard is not installed (pip install tensorboard)")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
