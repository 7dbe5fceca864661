"""Training from the window: worker thread + queue, Stop/close, crashes, and real runs.

The tests marked "engine" train the tiny built-in model on the CPU (about 20 s each).
"""
from __future__ import annotations

import json
import threading
import tkinter
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from modules.config import load_config
from modules.events import CompileEvent, Progress
from tests.app.conftest import pump

RUN_TIMEOUT = 240


@pytest.fixture
def app(shared_app):
    """The file's one window, reset to a fresh one's state before each test (conftest)."""
    return shared_app


def on_the_demo(app):
    """The shared window with the demo preset loaded, as a window opens on it
    (test_presets_and_settings.py checks that it does: the remembered last preset)."""
    from tests.app.conftest import REPO
    assert app.presets_bar.load(REPO / "training_presets" / "demo.json")
    return app


@pytest.fixture
def off_thread_tk_calls(monkeypatch):
    """Every widget configure / canvas draw made off the main thread (should stay empty)."""
    calls: list[str] = []
    original_configure, original_create = tkinter.Misc._configure, tkinter.Canvas._create

    def configure(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            calls.append(f"configure {self} on {threading.current_thread().name}")
        return original_configure(self, *args, **kwargs)

    def create(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            calls.append(f"canvas create on {threading.current_thread().name}")
        return original_create(self, *args, **kwargs)

    monkeypatch.setattr(tkinter.Misc, "_configure", configure)
    monkeypatch.setattr(tkinter.Canvas, "_create", create)
    return calls


def progress(step: int, total: int = 3) -> Progress:
    return Progress(step=step, max_steps=total, epoch=1, max_epochs=1, loss=1.0 / step,
                    smoothed_loss=1.0 / step, lr=1e-4, seconds_per_step=0.5,
                    eta_seconds=0.5 * (total - step))


def test_worker_events_reach_widgets_on_the_tk_thread_and_a_crash_is_shown(
        app, tmp_path, off_thread_tk_calls):
    sample = tmp_path / "sample.png"
    Image.new("RGB", (64, 64), "red").save(sample)
    app.registry.find("output.dir").var.set(str(tmp_path / "out"))

    def crashing_train(config, callbacks, commands):
        assert threading.current_thread() is not threading.main_thread()
        callbacks.on_status("fake training")
        callbacks.on_compile(CompileEvent("unet", "INDUCTOR failed; falling back to DEFAULT",
                                          kind="fallback"))
        for step in (1, 2, 3):
            callbacks.on_progress(progress(step))
        callbacks.on_sample(sample, "a red square", 3)
        callbacks.on_saved(tmp_path / "out" / "final", 3)
        raise RuntimeError("boom in step 3")

    app.runs.train_fn = crashing_train
    assert app.runs.start()
    assert app.tabview.get() == "Run"
    pump(app, lambda: app.runs.worker is None)
    panel = app.run_panel
    assert "Training crashed: RuntimeError: boom in step 3" in panel.status.cget("text")
    log = panel.log_text()
    assert "WARNING compile: Inductor failed; falling back to Default" in log
    assert "boom in step 3" in log and "saved" in log
    assert panel.step_bar.get() == pytest.approx(1.0)
    assert panel.step_label.cget("text") == "3/3 · crashed · loss 0.3333"  # no rate, no ETA
    assert panel.plot.steps == [1, 2, 3] and panel.plot.canvas.find_withtag("curve")
    assert panel.sample_paths == [sample] and panel.sample_widgets[0].cget("image") is not None
    assert panel.buttons["start"].cget("state") == "normal"      # the window stays usable

    def fine_train(config, callbacks, commands):
        callbacks.on_status("second run ok")
        return SimpleNamespace(status="finished", steps=3, output_dir=tmp_path / "out")

    app.runs.train_fn = fine_train
    assert app.runs.start()
    pump(app, lambda: app.runs.worker is None)
    assert "second run ok" in panel.log_text()
    assert panel.status.cget("text").startswith("finished: 3 steps")
    assert app.guard.violations == []
    assert off_thread_tk_calls == []


def test_the_thread_guard_catches_an_off_thread_update():
    from app.thread_guard import ThreadGuard, tk_thread_only

    class Panel:
        guard = ThreadGuard()

        @tk_thread_only
        def set_status(self, text):
            return text

    panel = Panel()
    panel.set_status("on the Tk thread")
    assert panel.guard.violations == []
    worker = threading.Thread(target=panel.set_status, args=("off it",), name="intruder")
    worker.start()
    worker.join()
    assert len(panel.guard.violations) == 1
    assert panel.guard.violations[0].endswith("Panel.set_status ran on thread 'intruder'")


def test_closing_during_training_asks_then_stops_and_waits_for_the_save(make_app, tmp_path):
    answers = [False, True]
    app = make_app(confirm=lambda title, message: answers.pop(0),
                   builtin_presets_dir=tmp_path / "none")
    app.registry.find("output.dir").var.set(str(tmp_path / "out"))
    saved = tmp_path / "saved-on-stop"
    started = threading.Event()

    def waits_for_stop(config, callbacks, commands):
        started.set()
        while not commands.stop_requested:
            threading.Event().wait(0.01)
        threading.Event().wait(0.3)                 # "saving" takes a moment
        saved.write_text("final")
        return SimpleNamespace(status="stopped", steps=1, output_dir=tmp_path / "out")

    app.runs.train_fn = waits_for_stop
    app.runs.start()
    assert started.wait(10)
    app.on_close()                                  # answered "no": keeps training
    pump(app)
    assert not app.closed and app.runs.training and not app.runs.worker.commands.stop_requested
    app.on_close()                                  # answered "yes"
    assert app.runs.worker.commands.stop_requested and not app.closed
    pump(app, lambda: app.closed, timeout=10)       # closes by itself once the save is done
    assert saved.exists()


def gui_demo_settings(app, out: Path, max_steps: int) -> None:
    """The demo preset made small through the widgets, as a user would."""
    find = app.registry.find
    for path, text in (("training.max_steps", str(max_steps)), ("training.batch_size", "1"),
                       ("sampling.every_steps", "0"), ("sampling.steps", "2"),
                       ("output.save_every_steps", "0"), ("output.dir", str(out))):
        find(path).var.set(text)
    find("sampling.prompts").set_text("a red circle on a blue background")
    assert app.binding.errors == {}


@pytest.mark.engine
def test_a_real_run_reaches_100_percent_with_sample_and_loss_curve(
        app, tmp_path, off_thread_tk_calls):
    on_the_demo(app)
    out = tmp_path / "run"
    gui_demo_settings(app, out, max_steps=4)
    assert app.runs.start(), [str(p) for p in app.binding.problems()]
    pump(app, lambda: app.runs.worker is None, timeout=RUN_TIMEOUT)
    panel = app.run_panel
    assert app.runs.last_result is not None, panel.log_text()
    assert app.runs.last_result.status == "finished" and app.runs.last_result.steps == 4
    assert panel.step_bar.get() == pytest.approx(1.0)
    assert panel.step_label.cget("text").startswith("4/4")
    assert panel.plot.steps == [1, 2, 3, 4] and panel.plot.canvas.find_withtag("curve")
    assert panel.sample_paths and all(p.is_file() for p in panel.sample_paths)
    assert panel.sample_paths[0].parent.parent == out
    assert (out / "final").is_dir()
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    assert app.guard.violations == [] and off_thread_tk_calls == []


@pytest.mark.engine
def test_stop_mid_run_saves_a_final_checkpoint(app, tmp_path):
    on_the_demo(app)
    out = tmp_path / "stopped"
    gui_demo_settings(app, out, max_steps=500)
    assert app.runs.start()
    pump(app, lambda: len(app.run_panel.plot.steps) >= 1, timeout=RUN_TIMEOUT)
    app.run_panel.buttons["stop"].invoke()
    pump(app, lambda: app.runs.worker is None, timeout=RUN_TIMEOUT)
    assert app.runs.last_result.status == "stopped" and app.runs.last_result.steps < 500
    assert (out / "final").is_dir()
    assert json.loads((out / "run.json").read_text())["status"] == "stopped"
    assert app.run_panel.buttons["start"].cget("state") == "normal"


@pytest.mark.engine
def test_what_the_gui_saves_is_what_the_cli_trains(app, tmp_path):
    from modules.cli.train import main
    on_the_demo(app)
    find = app.registry.find
    find("training.lora_rank").var.set("4")
    find("training.learning_rate").var.set("0.0005")
    find("training.seed").var.set("7")
    find("training.batch_size").var.set("1")
    find("sampling.steps").var.set("2")
    find("sampling.every_steps").var.set("0")
    find("sampling.prompts").set_text("a green triangle")
    find("compile.backend").menu._dropdown_callback("AOT_EAGER")
    find("compile.denoiser").toggle.toggle()             # compile nothing: keeps the test fast
    presets = tmp_path / "presets"
    find("output.dir").var.set(str(presets / "runs" / "mine"))
    saved = app.presets_bar.save_as(presets / "mine.json")
    stored = json.loads(saved.read_text())
    assert stored["output"]["dir"] == "runs/mine"   # relative to the preset's folder
    out = tmp_path / "cli-out"
    code = main(["--config", str(saved), "--set", "training.max_steps=2",
                 "--set", f"output.dir={out}", "--quiet"])
    assert code == 0
    resolved = load_config(out / "config.json")
    assert resolved.training.lora_rank == 4
    assert resolved.training.learning_rate == 0.0005
    assert resolved.training.seed == 7
    assert resolved.sampling.prompts == ["a green triangle"]
    assert resolved.compile.backend.value == "AOT_EAGER" and resolved.compile.denoiser is False
    assert resolved.training.max_steps == 2
