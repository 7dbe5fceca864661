"""The window around a run: Resume from a backup, Check compilation and training refusing each
other, unsaved edits, the TRITON note, and every prompt's sample of the latest step."""
from __future__ import annotations

import pytest

import json
import threading
from pathlib import Path
from types import SimpleNamespace

from PIL import Image

from modules.events import CompileEvent
from tests.app.conftest import pump


@pytest.fixture
def app(shared_app):
    """The file's one window, reset to a fresh one's state before each test (conftest)."""
    return shared_app


def fake_backup(output: Path, step: int) -> None:
    folder = output / "backups" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / "backup.json").write_text("{}")
    (folder / "tensors.safetensors").write_bytes(b"")


def test_resume_is_offered_for_a_killed_run_and_starts_from_the_newest_backup(app, tmp_path):
    output = tmp_path / "out"
    panel = app.run_panel
    app.registry.find("output.dir").var.set(str(output))
    pump(app)
    assert panel.buttons["resume"].cget("state") == "disabled"
    fake_backup(output, 20)
    fake_backup(output, 40)
    (output / "run.json").write_text(json.dumps({"status": "running"}))  # killed: no end
    app.runs.refresh_resume()
    assert panel.buttons["resume"].cget("text") == "Resume from step 40"
    assert panel.buttons["resume"].cget("state") == "normal"
    assert "was killed or crashed" in panel.backups_label.cget("text")

    started = []

    def fake_train(config, callbacks, commands):
        started.append(config.training.resume_from)
        return SimpleNamespace(status="finished", steps=1, output_dir=output)

    app.runs.train_fn = fake_train
    import modules.frontend as frontend
    original = frontend.check_inputs
    frontend.check_inputs = lambda config: []  # the fake backups are not loadable ones
    try:
        assert app.runs.resume()
        pump(app, lambda: app.runs.worker is None)
    finally:
        frontend.check_inputs = original
    assert started == ["latest"]
    assert app.binding.config.training.resume_from == ""  # the form itself is unchanged


def test_check_compilation_is_off_while_training_and_its_report_goes_stale(app, tmp_path):
    panel = app.compile_panel
    app.compile_check.explain = lambda config: "UNet: AOT_EAGER, graph_breaks 0"
    panel.backend.menu._dropdown_callback("AOT_EAGER")
    panel.check_button.invoke()
    pump(app, lambda: "graph_breaks" in panel.report_text())
    panel.backend.menu._dropdown_callback("INDUCTOR")  # the report no longer describes this
    assert panel.report_text().startswith("OUTDATED")

    release = threading.Event()

    def slow_train(config, callbacks, commands):
        release.wait(30)
        return SimpleNamespace(status="finished", steps=1, output_dir=tmp_path)

    app.registry.find("output.dir").var.set(str(tmp_path / "out"))
    app.runs.train_fn = slow_train
    assert app.runs.start()
    assert panel.check_button.cget("state") == "disabled"
    assert "not while training" in panel.check_hint.cget("text")
    release.set()
    pump(app, lambda: app.runs.worker is None)
    assert panel.check_button.cget("state") == "normal"


def test_start_is_refused_while_check_compilation_runs(app, tmp_path):
    panel, run = app.compile_panel, app.run_panel
    start = run.buttons["start"]
    release = threading.Event()

    def slow_explain(config):
        release.wait(30)
        return "UNet: AOT_EAGER, graph_breaks 0"

    started = []

    def fake_train(config, callbacks, commands):
        started.append(config)
        return SimpleNamespace(status="finished", steps=1, output_dir=tmp_path)

    app.compile_check.explain, app.runs.train_fn = slow_explain, fake_train
    app.registry.find("output.dir").var.set(str(tmp_path / "out"))
    pump(app)
    assert start.cget("state") == "normal"
    panel.check_button.invoke()
    try:
        assert start.cget("state") == "disabled"
        assert "Check compilation is running" in run.button_tips["start"].text
        assert not app.runs.start()  # a click that gets through anyway is refused too
        assert "Check compilation is running" in run.status_text and run.status_error
        assert app.runs.worker is None and started == []
        # a benchmark ending meanwhile does not let Start through while the check still runs
        app.runs.benchmark_changed(True)
        app.runs.benchmark_changed(False)
        assert start.cget("state") == "disabled"
        assert "Check compilation is running" in run.button_tips["start"].text
    finally:
        release.set()
    pump(app, lambda: "graph_breaks" in panel.report_text())
    assert start.cget("state") == "normal" and run.button_tips["start"].text == ""
    assert panel.check_button.cget("state") == "normal"
    assert app.runs.start()
    pump(app, lambda: app.runs.worker is None)
    assert len(started) == 1


@pytest.mark.parametrize("field", [
    "training.channels_last",           # the UNet compiles with another memory layout
    "training.gradient_checkpointing",  # with REGIONAL scope it decides whether CUDA graphs stay
])
def test_a_toggle_the_compile_plan_depends_on_writes_the_config_and_outdates_a_check(app, field):
    panel = app.compile_panel
    app.compile_check.explain = lambda config: "UNet: AOT_EAGER, graph_breaks 0"
    panel.check_button.invoke()
    pump(app, lambda: "graph_breaks" in panel.report_text())
    section, name = field.split(".")
    before = getattr(getattr(app.binding.config, section), name)
    view = app.registry.find(field)
    view.toggle.toggle()  # a click
    assert getattr(getattr(app.binding.config, section), name) is (not before)
    assert panel.report_text().startswith("OUTDATED")


def test_unsaved_edits_are_marked_and_loading_another_preset_asks(app, tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(app.presets_bar, "confirm",
                        lambda title, message: asked.append(title) or False)
    app.settings.user_presets_dir = str(tmp_path / "presets")  # another preset to pick
    other = tmp_path / "presets" / "other.json"
    other.parent.mkdir()
    other.write_text(json.dumps({"config_version": 1, "training": {"max_steps": 5}}))
    app.presets_bar.refresh()
    preset = tmp_path / "mine.json"
    preset.write_text(json.dumps({"config_version": 1, "training": {"max_steps": 7}}))
    assert app.presets_bar.load(preset)
    assert app.title() == "Tempera — mine.json"
    app.registry.find("training.max_steps").var.set("8")
    pump(app)
    assert app.title() == "Tempera — mine.json *"
    app.presets_bar.menu.set(app.presets_bar.presets[0].label)
    assert app.presets_bar.load_selected() is False  # the user said no: edits kept
    assert asked == ["Discard your changes?"]
    assert app.binding.config.training.max_steps == 8


def test_triton_on_a_machine_without_cuda_says_it_runs_as_inductor(app):
    panel = app.compile_panel
    panel._load_summaries()
    panel.backend.menu._dropdown_callback("TRITON")
    text = panel.description.cget("text")
    assert "runs as INDUCTOR" in text and "torch.compile(" in text


def test_every_prompt_of_the_latest_step_is_shown_and_compiling_is_busy(app, tmp_path):
    images = []
    for i, color in enumerate(("red", "blue", "green")):
        images.append(tmp_path / f"s{i}.png")
        Image.new("RGB", (64, 64), color).save(images[-1])
    from modules.train.state.history import CompileExpectation
    app.runs.expected_compile = CompileExpectation(65.0, warm=False, cold_seconds=65.0,
                                              graphs={"unet": 12})
    panel = app.run_panel
    app._handle(SimpleNamespace(kind="compile", payload=CompileEvent(
        "unet", "compiling UNet (INDUCTOR, 12 regions)…", kind="progress")))
    assert panel.step_bar.cget("mode") == "indeterminate"
    assert "expected about 1:05 (last run with these settings)" in panel.step_label.cget("text")
    app._handle(SimpleNamespace(kind="compile", payload=CompileEvent(
        "unet", "compiling UNet: graph 3 (4.0 s so far)", kind="progress", graph=3)))
    assert panel.step_label.cget("text").startswith("compiling UNet: graph 3 of 12 (4.0 s")
    app.runs.expected_compile = CompileExpectation(12.0, warm=True, cold_seconds=228.0, graphs={})
    app._handle(SimpleNamespace(kind="compile", payload=CompileEvent(
        "unet", "compiling UNet: graph 3 (4.0 s so far)", kind="progress", graph=3)))
    text = panel.step_label.cget("text")
    assert "graph 3 (" in text and "expected about 0:12 (compile cache warm)" in text
    app._handle(SimpleNamespace(kind="sample", payload=(images[0], "old prompt", 10)))
    app._handle(SimpleNamespace(kind="sample", payload=(images[1], "a blue one", 20)))
    app._handle(SimpleNamespace(kind="sample", payload=(images[2], "a green one", 20)))
    assert panel.sample_paths == images[1:]  # step 20's two prompts, step 10's gone
    assert panel.sample_caption.cget("text") == "step 20"
    # each prompt under its own image, not both prompts run together under both
    assert [c.cget("text") for c in panel.sample_captions] == ["a blue one", "a green one"]
    for image, caption in zip(panel.sample_widgets, panel.sample_captions):
        assert caption.master is image.master and caption.grid_info() == {}  # packed below it
        assert image.master.grid_info()["column"] in (0, 1)
    assert [c.master.grid_info()["column"] for c in panel.sample_captions] == [0, 1]
    sizes = {image.cget("size") for image in panel._sample_images}
    assert len(sizes) == 1 and max(sizes.pop()) == 160  # side by side, the same size


def test_a_larger_ui_scale_keeps_the_window_on_screen_and_the_scale_control_reachable(app):
    app.geometry("1000x680")
    pump(app)
    width = app.winfo_width()
    app.sizing.scale_chosen("150%")
    pump(app)
    for _ in range(5):
        app.update()
    assert abs(app.winfo_width() - width) <= 0.05 * width  # the window kept its size
    menu = app.sizing.scale_menu
    assert menu.winfo_ismapped()
    right = menu.winfo_rootx() + menu.winfo_width() - app.winfo_rootx()
    assert right <= app.winfo_width()  # the way back is on screen
    app.sizing.scale_chosen("100%")
    pump(app)
    assert abs(app.winfo_width() - width) <= 0.05 * width
