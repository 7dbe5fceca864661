"""File and folder choosers: the desktop's own where Linux has one, else Tk's.

Tk's chooser is native on Windows and macOS; on Linux it is Tk's own, dated one. There the
desktop's chooser is used when installed: zenity (GNOME and most desktops) or kdialog (KDE).
Set TEMPERA_FILE_DIALOG=tk to always use Tk's. The window stays responsive (it is redrawn,
training events keep arriving) while the chooser is open; only one chooser opens at a time.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from tkinter import filedialog
from typing import Any

Filter = tuple[str, tuple[str, ...]]  # (name, ("*.json", ...))

CHOOSERS = ("zenity", "kdialog")
_open = False  # a chooser is open (its loop keeps the window live)


def desktop_chooser() -> str | None:
    """zenity or kdialog when this is Linux and one is installed (None: use Tk's)."""
    if not sys.platform.startswith("linux") or os.environ.get("TEMPERA_FILE_DIALOG") == "tk":
        return None
    return next((tool for tool in CHOOSERS if shutil.which(tool)), None)


def chooser_command(tool: str, kind: str, title: str, start: str,
                    file_filter: Filter | None) -> list[str]:
    """The command line asking `tool` for a folder ("folder"), an existing file ("open") or a
    file to write ("save"), starting at `start`."""
    patterns = " ".join(file_filter[1]) if file_filter else ""
    if tool == "zenity":
        command = ["zenity", "--file-selection", f"--title={title}", f"--filename={start}"]
        command += {"folder": ["--directory"], "open": [],
                    "save": ["--save", "--confirm-overwrite"]}[kind]
        if file_filter:
            command += [f"--file-filter={file_filter[0]} | {patterns}", "--file-filter=All | *"]
        return command
    flag = {"folder": "--getexistingdirectory", "open": "--getopenfilename",
            "save": "--getsavefilename"}[kind]
    command = ["kdialog", "--title", title, flag, start]
    if file_filter and kind != "folder":
        command.append(f"{patterns}|{file_filter[0]}")
    return command


def _run_chooser(widget: Any, command: list[str]) -> str | None:
    """Run a chooser while keeping the window drawn; its answer, or None when cancelled."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True)
    while process.poll() is None:
        widget.update()
        time.sleep(0.03)
    answer = process.stdout.read().strip() if process.stdout else ""
    return answer if process.returncode == 0 and answer else None


def _ask(widget: Any, kind: str, title: str, start: str, file_filter: Filter | None,
         tk_fallback: Any) -> str | None:
    global _open
    if _open:
        return None
    _open = True
    try:
        tool = desktop_chooser()
        if tool is not None:
            try:
                return _run_chooser(widget, chooser_command(tool, kind, title, start,
                                                            file_filter))
            except OSError:
                pass  # the tool would not start: Tk's chooser still works
        return tk_fallback() or None
    finally:
        _open = False


def start_folder(current: str) -> str:
    """Where a chooser opens: the current value's folder when it exists, else home."""
    path = Path(current).expanduser() if current.strip() else Path.home()
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return str(path) + os.sep


def ask_directory(widget: Any, title: str, current: str = "") -> str | None:
    start = start_folder(current)
    return _ask(widget, "folder", title, start, None, lambda: filedialog.askdirectory(
        parent=widget, title=title, initialdir=start))


def ask_open_file(widget: Any, title: str, current: str, file_filter: Filter) -> str | None:
    start = start_folder(current)
    return _ask(widget, "open", title, start, file_filter, lambda: filedialog.askopenfilename(
        parent=widget, title=title, initialdir=start,
        filetypes=[(file_filter[0], " ".join(file_filter[1])), ("All files", "*")]))


def ask_save_file(widget: Any, title: str, folder: Path, file_filter: Filter,
                  extension: str) -> str | None:
    """A file to write in (or below) `folder`; `extension` is added when the name has none."""
    start = str(folder) + os.sep
    chosen = _ask(widget, "save", title, start, file_filter, lambda: filedialog.asksaveasfilename(
        parent=widget, title=title, initialdir=str(folder), defaultextension=extension,
        filetypes=[(file_filter[0], " ".join(file_filter[1]))]))
    if chosen and not Path(chosen).suffix:
        chosen += extension
    return chosen
