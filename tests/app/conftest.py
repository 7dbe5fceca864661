"""GUI test fixtures: one Xvfb display per session, windows made through `make_app`.

Every test in tests/app is marked `gui`. When tkinter, Xvfb or a display cannot be had, each test
here is skipped with the reason (install xvfb: scripts/ensure_xvfb.sh).
"""
from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from app.display import start_xvfb

REPO = Path(__file__).resolve().parents[2]


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: trains the tiny built-in model from the GUI "
                                       "(about 20 s each on 2 CPU cores)")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gui)


@pytest.fixture(scope="session")
def display() -> str:
    try:
        import tkinter
    except ImportError as exc:
        pytest.skip(f"GUI tests need tkinter: {exc}")
    proc = None
    if shutil.which("Xvfb"):
        try:
            proc, name = start_xvfb()
        except (OSError, RuntimeError) as exc:
            pytest.skip(f"could not start Xvfb: {exc}")
        os.environ["DISPLAY"] = name
    elif not os.environ.get("DISPLAY"):
        pytest.skip("GUI tests need Xvfb (apt-get install xvfb) or a DISPLAY")
    try:
        root = tkinter.Tk()
        root.destroy()
    except tkinter.TclError as exc:
        if proc:
            proc.kill()
        pytest.skip(f"cannot open a Tk window on {os.environ.get('DISPLAY')}: {exc}")
    yield os.environ["DISPLAY"]
    if proc is not None:
        proc.terminate()
        proc.wait(timeout=10)


def pump(app, until: Callable[[], bool] | None = None, timeout: float = 10.0) -> None:
    """Process Tk events until `until()` holds (or once, without a condition); fail on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if app.closed:
            if until is None or until():
                return
            raise AssertionError("the window closed while waiting")
        app.update()
        if until is None or until():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.02)


@pytest.fixture
def make_app(display, tmp_path):
    """Build a TemperaApp with an isolated settings file and auto-answered dialogs."""
    from app.window import TemperaApp
    apps = []

    def make(wait_for_engine: bool = True, **kwargs):
        kwargs.setdefault("settings_path", tmp_path / "ui.json")
        kwargs.setdefault("confirm", lambda title, message: True)
        kwargs.setdefault("ask_unsaved", lambda title, message: False)  # discard on close
        kwargs.setdefault("ask_replace", lambda message, folder: "replace")  # Start anew
        kwargs.setdefault("builtin_presets_dir", REPO / "training_presets")
        app = TemperaApp(**kwargs)
        apps.append(app)
        app.update()
        if wait_for_engine:  # Start waits for it (the first window of a session imports torch)
            pump(app, lambda: app.engine.done, timeout=180)
        return app

    yield make
    for app in apps:
        if app.closed:
            continue
        if app.runs.worker is not None:
            app.runs.worker.commands.request_stop()
            app.runs.worker.thread.join(timeout=120)
        app._finish_close()


@pytest.fixture
def app(make_app):
    """A window on default settings (no preset loaded)."""
    from modules.config import Config
    window = make_app(builtin_presets_dir=Path("/nonexistent-presets"))
    assert window.binding.config == Config()
    return window


@pytest.fixture
def real_input(display):
    """Real pointer and keyboard input (xdotool) into the session's Xvfb display."""
    from tests.app import xdo
    if not xdo.available():
        pytest.skip("real input needs xdotool (bash scripts/ensure_xvfb.sh)")


def shown(app) -> None:
    """The window on screen at a known size, with its layout settled."""
    from tests.app import xdo
    app.geometry("1200x800+0+0")
    xdo.settle(app, 0.5)
