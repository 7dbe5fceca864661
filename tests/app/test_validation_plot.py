"""The Run tab's loss plot shows validation as a second series beside the training loss: its
points, the best step ringed and named in the legend, and a resumed run's earlier passes."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from modules.events import Progress, ValidationScore
from tests.app.conftest import pump
from tests.app.test_run_state import fake_backup
from tests.app.test_training import RUN_TIMEOUT, gui_demo_settings


def progress(step: int, loss: float) -> Progress:
    return Progress(step=step, max_steps=6, epoch=1, max_epochs=1, loss=loss,
                    smoothed_loss=loss, lr=1e-4, seconds_per_step=0.5, eta_seconds=1.0)


def texts(canvas, tag: str) -> list[str]:
    return [canvas.itemcget(item, "text") for item in canvas.find_withtag(tag)]


def test_validation_points_are_a_second_series_with_the_best_step_named(app):
    plot = app.run_panel.plot
    for step, loss in enumerate([0.9, 0.8, 0.85, 0.7], start=1):
        app._handle(SimpleNamespace(kind="progress", payload=progress(step, loss)))
    app._handle(SimpleNamespace(kind="validation", payload=ValidationScore(2, 0.6, 2, 0.6, 4)))
    app._handle(SimpleNamespace(kind="validation", payload=ValidationScore(4, 0.65, 2, 0.6, 4)))
    pump(app)

    assert plot.validation == [(2, 0.6), (4, 0.65)] and plot.best_step == 2
    assert [name for name, *_ in plot.series()] == ["loss", "smoothed", "validation"]
    canvas = plot.canvas
    assert len(canvas.find_withtag("validation")) == 3  # the joining line and two dots
    assert len(canvas.find_withtag("best")) == 1
    assert texts(canvas, "legend") == ["validation (best: step 2)", "smoothed", "loss"]
    # the y range covers the validation points too (0.6 is below every training loss)
    assert "0.6" in [canvas.itemcget(i, "text") for i in canvas.find_all()
                     if canvas.type(i) == "text"]

    app.run_panel.reset()
    assert plot.validation == [] and plot.best_step is None


def test_a_not_finite_pass_is_left_off_the_plot(app):
    plot = app.run_panel.plot
    app._handle(SimpleNamespace(kind="validation", payload=ValidationScore(3, None, None,
                                                                           None, 4)))
    assert plot.validation == [] and plot.series() == []


def test_a_resumed_run_shows_the_earlier_validation_passes(app, tmp_path):
    output = tmp_path / "out"
    fake_backup(output, 4)
    (output / "run.json").write_text(json.dumps({
        "status": "stopped", "losses": [0.9, 0.8, 0.7, 0.6, 0.5],
        "validation": {"history": [[2, 0.75], [4, 0.7], [5, 0.4]]}}))
    app.registry.find("output.dir").var.set(str(output))
    pump(app)
    app.runs._show_earlier_run(app.binding.config)
    plot = app.run_panel.plot
    assert plot.steps == [1, 2, 3, 4]
    assert plot.validation == [(2, 0.75), (4, 0.7)] and plot.best_step == 4  # not step 5's


@pytest.mark.engine
def test_a_real_run_with_validation_plots_every_pass(make_app, tmp_path):
    app = make_app()
    out = tmp_path / "run"
    gui_demo_settings(app, out, max_steps=2)
    app.registry.find("validation.every_steps").var.set("1")
    app.registry.find("validation.split_ratio").var.set("0.25")
    assert app.runs.start(), [str(p) for p in app.binding.problems()]
    pump(app, lambda: app.runs.worker is None, timeout=RUN_TIMEOUT)
    plot = app.run_panel.plot
    assert app.runs.last_result.status == "finished", app.run_panel.log_text()
    history = json.loads((out / "run.json").read_text())["validation"]["history"]
    assert [tuple(point) for point in history] == plot.validation
    assert [step for step, _ in plot.validation] == [1, 2]
    assert plot.best_step == min(history, key=lambda point: point[1])[0]
    assert plot.canvas.find_withtag("validation") and plot.canvas.find_withtag("best")
    assert "validation loss" in app.run_panel.log_text()
