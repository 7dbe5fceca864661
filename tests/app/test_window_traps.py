"""Issue 33 item 8: the desktop app's remaining traps, through the window with real pointer and
keyboard input (xdotool) where the trap is about input."""
from __future__ import annotations

import json
import os
import pytest

from app.form import scroll_to
from tests.child_env import with_repo_on_pythonpath
from tests.app import xdo
from tests.app.conftest import pump, shown


@pytest.fixture
def app(shared_app):
    """The file's one window, reset to a fresh one's state before each test (conftest)."""
    return shared_app


def write_preset(path, max_steps: int):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config_version": 1, "training": {"max_steps": max_steps}}))
    return path


def test_closing_with_unsaved_edits_asks_save_discard_or_cancel(make_app, tmp_path, real_input):
    answers, asked = [None], []
    app = make_app(ask_unsaved=lambda title, message: asked.append(title) or answers[0])
    preset = write_preset(tmp_path / "presets" / "mine.json", 7)
    app.settings.user_presets_dir = str(tmp_path / "presets")
    assert app.presets_bar.load(preset)
    shown(app)
    view = app.registry.find("training.max_steps")
    app.tabview.set("Training")
    scroll_to(app.scroll_frames["Training"], view.entry)  # the tab is longer than the window
    xdo.settle(app)
    xdo.click(app, view.entry)
    xdo.clear_and_type(app, "9")
    assert app.binding.config.training.max_steps == 9 and app.presets_bar.dirty

    app.on_close()                                    # Cancel: the window and the edit stay
    assert asked == ["Save your changes?"] and not app.closed
    assert app.binding.config.training.max_steps == 9

    answers[0] = True                                 # Save: written to the preset, then closed
    app.on_close()
    assert app.closed
    assert json.loads(preset.read_text())["training"]["max_steps"] == 9


def test_closing_and_discarding_leaves_the_preset_as_it_was(make_app, tmp_path):
    app = make_app(ask_unsaved=lambda title, message: False)
    preset = write_preset(tmp_path / "presets" / "mine.json", 7)
    assert app.presets_bar.load(preset)
    app.registry.find("training.max_steps").var.set("9")
    pump(app)
    app.on_close()
    assert app.closed
    assert json.loads(preset.read_text())["training"]["max_steps"] == 7


def test_a_clean_window_closes_without_asking(make_app):
    asked = []
    app = make_app(ask_unsaved=lambda title, message: asked.append(title))
    app.on_close()
    assert app.closed and asked == []


def test_declining_to_discard_keeps_the_loaded_preset_in_the_menu(app, tmp_path, real_input,
                                                                   monkeypatch):
    monkeypatch.setattr(app.presets_bar, "confirm", lambda title, message: False)
    app.settings.user_presets_dir = str(tmp_path / "presets")
    write_preset(tmp_path / "presets" / "a.json", 7)
    write_preset(tmp_path / "presets" / "b.json", 8)
    assert app.presets_bar.load(tmp_path / "presets" / "a.json")
    assert app.presets_bar.menu.get() == "mine / a"
    app.registry.find("training.max_steps").var.set("9")
    pump(app)
    shown(app)
    app.presets_bar.menu._dropdown_callback("mine / b")    # chosen, then Load clicked: "No"
    load = next(w for w in app.presets_bar.menu.master.winfo_children()
                if getattr(w, "cget", None) and _text(w) == "Load")
    xdo.click(app, load)
    assert app.binding.config.training.max_steps == 9
    assert app.presets_bar.current.name == "a.json"
    assert app.presets_bar.menu.get() == "mine / a"


def _text(widget) -> str | None:
    try:
        return widget.cget("text")
    except Exception:  # a frame has no text
        return None


def test_ctrl_a_selects_a_fields_text_so_typing_replaces_it(app, real_input):
    shown(app)
    app.tabview.set("Training")
    view = app.registry.find("training.max_steps")
    scroll_to(app.scroll_frames["Training"], view.entry)  # the tab is longer than the window
    xdo.settle(app)
    view.var.set("1234")
    xdo.click(app, view.entry)
    xdo._xdotool("key", "ctrl+a")
    xdo._xdotool("type", "--delay", "30", "56")
    xdo.settle(app)
    assert app.binding.config.training.max_steps == 56

    prompts = app.registry.find("sampling.prompts")
    app.tabview.set("Sampling")
    xdo.settle(app)
    box = prompts.focus_widget()
    xdo.click(app, box)
    xdo._xdotool("type", "--delay", "20", "one")
    xdo._xdotool("key", "Return")
    xdo._xdotool("type", "--delay", "20", "two")
    xdo._xdotool("key", "ctrl+a")
    xdo._xdotool("type", "--delay", "20", "x")
    xdo.settle(app, 0.6)
    assert app.binding.config.sampling.prompts == ["x"]


def test_fixing_a_problem_never_moves_the_fields(app, real_input):
    shown(app)
    for path, bad in (("training.batch_size", "four"), ("training.learning_rate", "5"),
                      ("training.max_steps", "x")):
        app.registry.find(path).var.set(bad)
    assert app.runs.start() is False
    count = len(app.problems_panel.buttons)
    assert count >= 3
    app.tabview.set("Training")
    xdo.settle(app)
    rate = app.registry.find("training.learning_rate")
    epochs = app.registry.find("training.epochs")
    panel_height = app.problems_panel.frame.winfo_height()
    before = (epochs.entry.winfo_rooty(), app.tabview.winfo_height())
    xdo.click(app, rate.entry)
    xdo._xdotool("key", "ctrl+a")
    xdo._xdotool("type", "--delay", "30", "0.001")
    pump(app, lambda: len(app.problems_panel.buttons) == count - 1)  # the list followed the fix
    xdo.settle(app)
    assert app.problems_panel.frame.winfo_height() == panel_height
    assert (epochs.entry.winfo_rooty(), app.tabview.winfo_height()) == before


def test_resuming_shows_the_earlier_loss_curve_and_the_latest_samples(app, tmp_path):
    import threading
    from types import SimpleNamespace

    from PIL import Image

    from tests.app.test_run_state import fake_backup
    output = tmp_path / "out"
    app.registry.find("output.dir").var.set(str(output))
    app.registry.find("sampling.prompts").set_text("a red one\na blue one")
    fake_backup(output, 8)
    losses = [1.0, 0.9, None, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]  # step 3 was skipped
    (output / "run.json").write_text(json.dumps({"status": "running", "losses": losses}))
    (output / "samples").mkdir()
    for name in ("step-000004-0", "step-000008-1", "step-000008-0", "step-000010-0"):
        Image.new("RGB", (64, 64), "red").save(output / "samples" / f"{name}.png")
    release = threading.Event()

    def fake_train(config, callbacks, commands):
        release.wait(30)
        return SimpleNamespace(status="stopped", steps=8, output_dir=output)

    app.runs.train_fn = fake_train
    import modules.frontend as frontend
    original = frontend.check_inputs
    frontend.check_inputs = lambda config: []  # the fake backup is not a loadable one
    try:
        assert app.runs.resume()
        plot, panel = app.run_panel.plot, app.run_panel
        # up to the backup's step 8 (steps 9 and 10 are retrained), the skipped step left out
        assert plot.steps == [1, 2, 4, 5, 6, 7, 8]
        assert plot.losses[:2] == [1.0, 0.9]
        assert plot.smoothed[0] == 1.0 and 0.9 < plot.smoothed[1] < 1.0
        assert plot.canvas.find_withtag("curve")  # drawn, not only kept
        assert [p.name for p in panel.sample_paths] == ["step-000008-0.png",
                                                        "step-000008-1.png"]
        assert panel.sample_caption.cget("text") == "step 8"
        assert [c.cget("text") for c in panel.sample_captions] == ["a red one", "a blue one"]
    finally:
        release.set()
        pump(app, lambda: app.runs.worker is None)
        frontend.check_inputs = original


def test_the_backend_description_wraps_inside_the_window(app):
    """At 100 % and 150 %, in a 1024-pixel window and a wider one (each scale set once: a
    change redraws every widget, seconds)."""
    panel = app.compile_panel
    app.tabview.set("Advanced Options")
    panel._load_summaries()
    panel.backend.menu._dropdown_callback("INDUCTOR")  # the longest: its torch.compile(...) line
    for scale, width in ((1.0, 1024), (1.5, 1024), (1.5, 1400)):
        if app.settings.scaling != scale:
            app.sizing.scale_chosen(f"{int(scale * 100)}%")
        app.geometry(f"{int(width / scale)}x{int(680 / scale)}+0+0")
        xdo.settle(app, 0.6)
        label = panel.description._label                  # the tk label inside the CTkLabel
        assert "torch.compile(" in label.cget("text"), (scale, width)
        box_right = panel.box.winfo_rootx() + panel.box.winfo_width()
        assert label.winfo_rootx() + label.winfo_width() <= box_right, (scale, width)
        assert label.winfo_reqwidth() <= label.winfo_width() + 2, (scale, width)  # not cut off
    app.sizing.scale_chosen("100%")


LAUNCH = """
import subprocess, sys, threading, time
from pathlib import Path
importers = []
class Watch:  # torch's import: from which thread, and when it began
    def find_spec(self, name, path, target=None):
        if name == "torch":
            importers.append((threading.current_thread().name, time.monotonic()))
sys.meta_path.insert(0, Watch())
from app.main import run_window
from app.window import TemperaApp
app = TemperaApp(settings_path=Path(sys.argv[1]))
mapped = [time.monotonic()] if app.winfo_viewable() else []  # deiconify waits for the map
last, gaps = time.monotonic(), []
deadline = last + 120
while not app.engine.done and time.monotonic() < deadline:
    app.update()
    now = time.monotonic()
    if importers and now > importers[0][1]:
        gaps.append(now - last)  # one turn of the Tk loop while torch loads
    last = now
    time.sleep(0.01)
began = importers[0][1] if importers else float("inf")
print("importers", [name for name, _ in importers], flush=True)
print("mapped_before_import", bool(mapped) and mapped[0] < began)
print("import_s", round(last - began, 2), "longest_pause_s", round(max(gaps or [0]), 2))
print("engine", app.engine_ready, app.run_panel.status_text)
print("description", app.compile_panel._summaries, flush=True)
if sys.argv[2] != "close":
    app._finish_close()
    sys.exit(0)
app.registry.find("training.max_steps").var.set("9")  # an unsaved edit: closing asks

def answer_no():  # runs inside the dialog's own event loop
    if not app.winfo_exists() or not int(app.tk.call("winfo", "exists", ".__tk__messagebox.no")):
        app.after(100, answer_no)
        return
    app.update_idletasks()
    # Tk's own dialog (msgbox.tcl): its buttons are Tcl widgets, read through winfo
    x, y, w, h = (int(app.tk.call("winfo", what, ".__tk__messagebox.no"))
                  for what in ("rootx", "rooty", "width", "height"))
    subprocess.run(["xdotool", "mousemove", "--sync", str(x + w // 2), str(y + h // 2)],
                   check=True)
    subprocess.run(["xdotool", "click", "1"], check=True)
    print("answered", time.time(), flush=True)

app.after(200, answer_no)
app.after(100, lambda: app.tk.eval(app.protocol("WM_DELETE_WINDOW")))  # the close button
run_window(app)
import gc
print("frozen", gc.get_freeze_count(), flush=True)
print("closed", app.closed, time.time(), flush=True)
"""


@pytest.fixture(scope="module")
def launched(display, tmp_path_factory):
    """One fresh process, as at launch (about 15 s: the window is built and torch is imported
    for real), read by the two tests below: how it loaded torch, then (with xdotool) how it
    closed after *No* to "Save your changes?", answered with the pointer in the real dialog.
    Returns its printed lines and when it had ended, as this process saw it."""
    import subprocess
    import sys
    import time

    from tests.app.conftest import REPO
    settings = tmp_path_factory.mktemp("launch") / "ui.json"
    done = subprocess.run([sys.executable, "-c", LAUNCH, str(settings),
                           "close" if xdo.available() else "load"],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=with_repo_on_pythonpath())
    ended = time.time()
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line), ended


def test_the_window_stays_responsive_while_torch_is_imported(launched):
    """Torch is imported in a thread once the window is on screen, and the Tk loop never
    waits for the whole import (it froze for all of it when torch was imported on the Tk
    thread: 12 s of grey window under load)."""
    lines, _ = launched
    assert lines["importers"] == "['tempera-engine']"           # not the Tk (main) thread
    assert lines["mapped_before_import"] == "True"
    words = lines["import_s"].split()
    import_s, pause_s = float(words[0]), float(words[2])
    assert pause_s < max(0.5 * import_s, 0.3), lines              # the window kept turning
    assert lines["engine"].startswith("True ")                   # then imported
    assert "Loading the training engine" not in lines["engine"]
    assert lines["description"] == "True"


def test_the_window_is_drawn_and_takes_edits_while_the_engine_loads(make_app, real_input):
    """Issue 44 item 2: torch's import (held back here by the test's engine loader, which the
    window calls in place of `frontend.load_engine`) leaves the window drawn, saying that it
    loads, and a click and typing edit a field meanwhile; Start waits for it."""
    import threading

    from PIL import ImageGrab

    from modules import frontend
    release, loaded_on = threading.Event(), []

    def slow_engine() -> None:
        loaded_on.append(threading.current_thread().name)
        if not release.wait(60):
            raise RuntimeError("the test never let the engine load")
        frontend.load_engine()

    app = make_app(load_engine=slow_engine, wait_for_engine=False)
    try:
        shown(app)
        pump(app, lambda: bool(loaded_on))
        assert loaded_on == ["tempera-engine"] and not app.engine_ready
        tab = app.tabview._segmented_button._buttons_dict["Training"]
        xdo.click(app, tab)
        assert app.tabview.get() == "Training"
        view = app.registry.find("training.max_steps")
        assert xdo.scroll_into_view(app, app.scroll_frames["Training"], view.frame)
        # drawn: the label's text is painted (dark pixels on the light page), not a grey box
        label = view.label
        box = (label.winfo_rootx(), label.winfo_rooty(),
               label.winfo_rootx() + label.winfo_width(), label.winfo_rooty() + label.winfo_height())
        darkest, lightest = ImageGrab.grab(bbox=box, xdisplay=os.environ["DISPLAY"]).convert(
            "L").getextrema()
        assert darkest < 100 < lightest
        xdo.click(app, view.entry)
        xdo.clear_and_type(app, "77")
        assert app.binding.config.training.max_steps == 77 and not app.engine_ready
        panel = app.run_panel
        assert panel.status_text.endswith("Loading the training engine (torch)…")
        assert panel.buttons["start"].cget("state") == "disabled"
        assert "still loading" in panel.button_tips["start"].text
        assert app.compile_panel.check_button.cget("state") == "disabled"
        assert not app.runs.start()                      # a click that gets through anyway
        assert "still loading" in panel.status_text
    finally:
        release.set()
    pump(app, lambda: app.engine_ready, timeout=120)
    assert panel.buttons["start"].cget("state") == "normal" and panel.button_tips["start"].text == ""
    assert app.compile_panel.check_button.cget("state") == "normal"
    assert "Loading the training engine" not in app.run_panel.status_text
    assert "torch.compile" in app.compile_panel.description.cget("text") or \
        "eager" in app.compile_panel.description.cget("text")


def test_closing_with_no_leaves_promptly(launched, real_input):
    """Issue 44 item 7: after *No* to "Save your changes?" the process took 9 s to end (Python
    collecting every object torch made at exit). The launched process (`launched`), torch
    loaded, the real dialog, its No clicked with the pointer."""
    lines, ended = launched
    closed, returned = lines["closed"].split()
    assert closed == "True"
    # the cause of the slow exit is handled: what torch made is left to the exit, uncollected
    # (the whole heap: over 100,000 objects once torch is loaded)
    assert int(lines["frozen"]) > 100_000, lines["frozen"]
    # The speed itself is not asserted (an exit that frees nothing took 4 s on a machine at a
    # load of 20): the check above is what makes it prompt; this bound only catches a hang.
    closing, leaving = float(returned) - float(lines["answered"]), ended - float(returned)
    assert closing < 60 and leaving < 60, (closing, leaving)


def test_the_engine_loader_turns_the_collector_back_on_whoever_ends_last():
    """The collector is off while torch is imported in the loader's thread (a collection
    there could finalize a Tk object and wait for the Tk thread); it comes back once both
    the import and the window are done with it, in either order."""
    import gc
    import queue
    import threading

    from app.engine_loader import EngineLoader
    assert gc.isenabled()
    held = threading.Event()
    loader = EngineLoader(lambda: held.wait(10), queue.Queue())
    try:
        loader.start()
        assert not gc.isenabled() and loader.loading
        loader.close()                          # the window closed first
        assert not gc.isenabled()
        held.set()
        loader.thread.join(10)
        assert gc.isenabled()
        loader = EngineLoader(lambda: None, queue.Queue())
        loader.start()
        loader.thread.join(10)
        assert not gc.isenabled()               # until the window took the outcome
        loader.finished(True)
        assert gc.isenabled() and loader.ready and not loader.loading
    finally:
        held.set()
        gc.enable()
