"""The Run tab after a run finished: no Resume (a resume would re-train its end over final/),
only Continue once Max steps is raised past its end; and Resume on the demo preset, which ships
with output.overwrite on. Real training from the window (the tiny built-in model)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from modules.train.state.resume_offer import saved_step
from tests.app.conftest import pump
from tests.app.test_training import RUN_TIMEOUT, gui_demo_settings


def run_json(output: Path) -> dict:
    return json.loads((output / "run.json").read_text())


@pytest.mark.engine
def test_a_finished_run_offers_no_resume_only_continue_when_max_steps_is_raised(make_app,
                                                                                 tmp_path):
    app = make_app()
    assert app.presets_bar.current.name == "demo.json" and app.binding.config.output.overwrite
    out = tmp_path / "run"
    gui_demo_settings(app, out, max_steps=4)
    app.registry.find("output.backup_every_steps").var.set("1")
    assert app.runs.start(), [str(p) for p in app.binding.problems()]
    pump(app, lambda: app.runs.worker is None, timeout=RUN_TIMEOUT)
    assert app.runs.last_result.status == "finished", app.run_panel.log_text()
    panel, resume = app.run_panel, app.run_panel.buttons["resume"]
    pump(app)
    assert resume.cget("state") == "disabled" and resume.cget("text") == "Resume"
    assert "finished at step 4" in panel.backups_label.cget("text")
    assert "finished at step 4" in panel.button_tips["resume"].text
    final = {p.name: p.read_bytes() for p in (out / "final").iterdir()}
    assert not app.runs.resume()  # pressed anyway (a stale button): refused, listed
    assert any("finished at step 4" in str(p) for p in app.problems_panel.problems)
    assert {p.name: p.read_bytes() for p in (out / "final").iterdir()} == final

    app.registry.find("training.max_steps").var.set("6")
    pump(app, lambda: resume.cget("state") == "normal")
    assert resume.cget("text") == "Continue for 2 more steps"
    resume.invoke()
    pump(app, lambda: app.runs.worker is None, timeout=RUN_TIMEOUT)
    assert app.runs.last_result.status == "finished" and app.runs.last_result.steps == 6
    record = run_json(out)
    assert record["resume_count"] == 1 and saved_step(out / "final") == 6
    assert record["overwrite"].startswith("not applied")  # the demo's overwrite = true
    assert "“Overwrite previous run” is not applied" in panel.log_text()  # its label
    assert resume.cget("state") == "disabled"  # finished again, at the raised maximum
