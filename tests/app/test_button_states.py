"""The run buttons follow the facts now, whatever changed them: Resume (issue 54 item 2) stayed
greyed "while torch loads" after the engine had loaded, and "while a benchmark runs" after it
was stopped, until a preset was loaded again."""
from __future__ import annotations

import threading
from pathlib import Path

from modules import frontend
from modules.config import Config, save_config
from tests.app.conftest import pump
from tests.app.test_run_state import fake_backup


def a_preset_with_backups(tmp_path: Path) -> Path:
    """A saved preset whose output folder holds a killed run's backup at step 20."""
    output = tmp_path / "out"
    fake_backup(output, 20)
    config = Config()
    config.output.dir = str(output)
    preset = tmp_path / "mine.json"
    save_config(config, preset, sparse=True)
    return preset


def test_resume_is_offered_once_the_engine_has_loaded_after_a_reopen(make_app, tmp_path):
    """The app reopened on a preset whose folder holds a backup: Resume waits for torch like
    Start, and is offered as soon as Start is."""
    release = threading.Event()

    def slow_engine() -> None:
        if not release.wait(60):
            raise RuntimeError("the test never let the engine load")
        frontend.load_engine()

    app = make_app(initial_preset=a_preset_with_backups(tmp_path), load_engine=slow_engine,
                   wait_for_engine=False, builtin_presets_dir=Path("/nonexistent-presets"))
    panel = app.run_panel
    resume, start = panel.buttons["resume"], panel.buttons["start"]
    try:
        assert resume.cget("text") == "Resume from step 20"
        assert resume.cget("state") == "disabled" and start.cget("state") == "disabled"
        assert "still loading" in panel.button_tips["resume"].text
    finally:
        release.set()
    pump(app, lambda: app.engine_ready, timeout=120)
    assert start.cget("state") == "normal"
    assert resume.cget("state") == "normal" and panel.button_tips["resume"].text == ""
    check = app.compile_panel.check_button
    assert check.cget("state") == "normal"


def test_resume_is_offered_again_once_a_benchmark_is_stopped(make_app, tmp_path):
    def bench(config, **kwargs):
        if not app.benchmark.stop_requested.wait(30):  # runs until Stop benchmark is pressed
            raise RuntimeError("the test never stopped the benchmark")
        raise RuntimeError("stopped by the test")

    app = make_app(initial_preset=a_preset_with_backups(tmp_path), bench_fn=bench,
                   builtin_presets_dir=Path("/nonexistent-presets"))
    panel = app.run_panel
    resume = panel.buttons["resume"]
    assert resume.cget("state") == "normal"
    assert app.benchmark.start()
    assert resume.cget("state") == "disabled"
    assert "a benchmark is running" in panel.button_tips["resume"].text
    app.benchmark.button.invoke()                                    # Stop benchmark
    pump(app, lambda: not app.benchmark.running
         and app.benchmark.button.cget("text") == "Benchmark…", timeout=30)
    assert panel.buttons["start"].cget("state") == "normal"
    assert resume.cget("state") == "normal" and panel.button_tips["resume"].text == ""
