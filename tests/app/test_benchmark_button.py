"""Advanced Options' "Benchmark…": a real short benchmark from the window, and its refusals."""
from __future__ import annotations

import pytest

from app.labels import enum_label
from modules.config.schema import CompileBackend
from tests.app.conftest import pump


@pytest.fixture
def app(shared_app):
    """The file's one window, reset to a fresh one's state before each test (conftest)."""
    return shared_app


def _tiny_settings(app, tempera_cache, tmp_path) -> None:
    for path, text in (("general.cache_dir", str(tempera_cache)),
                       ("output.dir", str(tmp_path / "out")), ("data.resolution", "64"),
                       ("training.batch_size", "2"), ("logging.tensorboard", "false")):
        assert app.binding.set_text(path, text) is None, path
    app.binding.set_value("compile.backend", CompileBackend.AOT_EAGER)


@pytest.mark.engine
def test_benchmark_button_runs_eager_against_the_chosen_backend(app, tempera_cache, tmp_path):
    _tiny_settings(app, tempera_cache, tmp_path)
    section = app.benchmark
    assert section.start()
    assert section.button.cget("text") == "Stop benchmark"
    assert not app.runs.start(), "training must wait for the benchmark"
    pump(app, until=lambda: not section.running and section.events.empty()
         and section.button.cget("text") == "Benchmark…", timeout=300)
    text, legend = section.text().rstrip("\n").split("\n\n")
    table = text.splitlines()
    assert legend == "NONE = None (eager) · AOT_EAGER = AOT eager (debug)"  # the menu's names
    assert table[0].split()[:2] == ["backend", "components"]
    assert [line.split()[0] for line in table[1:]] == ["NONE", "AOT_EAGER"]
    compiled = section.result.cells[1]
    assert compiled["status"] == "ok", compiled
    assert f"{compiled['speedup']:.2f}" in table[2]
    assert section.apply_button.cget("state") == "normal"

    section.use_fastest()
    expected = CompileBackend.AOT_EAGER if compiled["speedup"] > 1.0 else CompileBackend.NONE
    assert app.binding.config.compile.backend == expected
    assert enum_label(expected) in section.status.cget("text")  # the menu's name for it


def test_benchmark_refuses_an_invalid_form_without_running(app):
    calls = []
    app.benchmark.bench_fn = lambda *a, **k: calls.append(a)
    app.binding.set_text("data.resolution", "sixty-four")
    assert not app.benchmark.start()
    assert calls == [] and not app.benchmark.running
    assert "data.resolution" in [p.path for p in app.problems_panel.problems]


def test_benchmark_refuses_while_training(app, monkeypatch):
    calls = []
    app.benchmark.bench_fn = lambda *a, **k: calls.append(a)
    monkeypatch.setattr(type(app.runs), "training", property(lambda self: True))
    assert not app.benchmark.start()
    assert calls == [] and "Stop training first" in app.benchmark.status.cget("text")


def test_a_failing_benchmark_is_shown(app, tempera_cache, tmp_path):
    _tiny_settings(app, tempera_cache, tmp_path)

    def broken(config, **kwargs):
        raise RuntimeError("no space left on device")
    app.benchmark.bench_fn = broken
    assert app.benchmark.start()
    pump(app, until=lambda: "failed" in app.benchmark.text(), timeout=20)
    assert "RuntimeError: no space left on device" in app.benchmark.text()
    assert app.benchmark.apply_button.cget("state") == "disabled"
