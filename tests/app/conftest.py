"""GUI test fixtures: one Xvfb display per session, windows made through `make_app`.

Every test in tests/app is marked `gui`. When tkinter, Xvfb or a display cannot be had, each test
here is skipped with the reason (install xvfb: scripts/ensure_xvfb.sh).
"""
from __future__ import annotations

import dataclasses
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


# --- one window per test file, reset between its tests --------------------------------------
# Building a window is most of a window test's time (about 5 s of customtkinter drawing on an
# idle core, 15-25 s on a loaded one). The tests that only read and set the form share one
# window per file (`shared_app`), put back before each test to what a fresh one shows: the
# default config, no problem list, no preset, the first tab at the top, the scale and size it
# opened with. `_check_fresh` then fails the test at once if a part could not be put back.
@pytest.fixture(scope="module")
def _module_window(display, tmp_path_factory):
    from app.window import TemperaApp
    home = tmp_path_factory.mktemp("shared-window")
    window = TemperaApp(settings_path=home / "ui.json", confirm=lambda title, message: True,
                        ask_unsaved=lambda title, message: False,
                        ask_replace=lambda message, folder: "replace",
                        builtin_presets_dir=Path("/nonexistent-presets"))
    window.update()
    pump(window, lambda: window.engine.done, timeout=180)
    assert window.engine.ready
    window.update_idletasks()
    fresh = {"geometry": window.geometry(), "title": window.title(),
             "status": window.run_panel.status_text, "scale": window.settings.scaling,
             "tab": window.tabview.get(), "report": window.compile_panel.report_text(),
             "machines": dict(window.compile_panel._machines),
             "settings": dataclasses.replace(window.settings),
             "hooks": [(part, name, getattr(part, name)) for part, names in (
                 (window.benchmark, ("bench_fn",)), (window.compile_check, ("explain",)),
                 (window.runs, ("train_fn", "expected_compile")),
                 (window.presets_bar, ("confirm", "ask_save_path")),
                 (window.compile_panel, ("_detect_machine", "ask_export", "ask_import")))
                 for name in names],
             "buttons": {key: b.cget("text") for key, b in window.run_panel.buttons.items()}}
    yield window, fresh
    if not window.closed:
        if window.runs.worker is not None:
            window.runs.worker.commands.request_stop()
            window.runs.worker.thread.join(timeout=120)
        window._finish_close()


def reset_window(window, fresh: dict) -> None:
    """Put a shared window back to what a fresh one shows (see `_module_window`)."""
    from modules.config import Config
    assert not window.closed, "a test closed the shared window: give it its own (make_app)"
    # what a test that failed midway left running ends first, so that the next test's
    # outcome is its own (a fresh window was closed after each test, which stopped these)
    if window.benchmark.running:
        window.benchmark.stop_requested.set()
        pump(window, lambda: not window.benchmark.running and window.benchmark.events.empty()
             and window.benchmark.button.cget("text") == "Benchmark…", timeout=180)
    if window.runs.worker is not None:
        window.runs.worker.commands.request_stop()
        pump(window, lambda: window.runs.worker is None, timeout=180)
    pump(window)
    if window.settings.scaling != fresh["scale"]:
        window.sizing.scale_chosen(f"{int(fresh['scale'] * 100)}%")
        window.sizing.scale_menu.set(f"{int(fresh['scale'] * 100)}%")
    window.geometry(fresh["geometry"])
    # the problem list first: it re-marks the fields it marked, and `replace` below may
    # destroy a list row's fields (see the report of h-speed-app)
    window.problems_panel.hide()
    for part, name, value in fresh["hooks"]:  # what a test replaced (a fake benchmark, ...)
        setattr(part, name, value)
    window.compile_panel._machines.clear()
    window.compile_panel._machines.update(fresh["machines"])
    for field in dataclasses.fields(window.settings):  # a test's presets folder, ...
        setattr(window.settings, field.name, getattr(fresh["settings"], field.name))
    presets = window.presets_bar
    presets.current = None
    if window.binding.config != Config() or window.binding.errors:
        window.binding.replace(Config())  # every widget redrawn: a second of customtkinter
    presets.refresh()
    presets.set_dirty(False)
    window.title(fresh["title"])
    window.runs.tensorboard = None
    window.compile_panel.has_result = False
    window.compile_panel.show_report(fresh["report"])
    for key, text in fresh["buttons"].items():
        window.run_panel.buttons[key].configure(text=text)
    window.run_panel.reset("the latest samples appear here")
    window.runs.refresh_resume()
    for more in set(window.registry.more_of.values()):
        if more.expanded:
            more.collapse()
    window.tabview.set(fresh["tab"])
    for page in window.scroll_frames.values():
        page._parent_canvas.yview_moveto(0.0)
    window.focus_set()
    window.update_idletasks()
    window.sizing.fit_columns()
    pump(window)
    window.run_panel.set_status(fresh["status"])
    _check_fresh(window, fresh)


def _check_fresh(window, fresh: dict) -> None:
    from modules.config import Config
    assert window.binding.config == Config() and window.binding.errors == {}
    assert [v.path for v in window.registry.all_views() if v.error] == []
    assert not window.problems_panel.is_open and not window.presets_bar.dirty
    assert window.settings.scaling == fresh["scale"] and window.tabview.get() == fresh["tab"]
    assert not any(more.expanded for more in window.registry.more_of.values())


@pytest.fixture
def shared_app(_module_window):
    """The file's shared window on default settings, as fresh (see `_module_window`)."""
    window, fresh = _module_window
    reset_window(window, fresh)
    return window
