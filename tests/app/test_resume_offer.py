"""The Run tab after a run finished: no Resume (a resume would re-train its end over final/),
only Continue once Max steps is raised past its end; and Resume on the demo preset, which ships
with output.overwrite on. Real training from the window (the tiny built-in model)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from modules import frontend
from modules.train.state.resume_offer import saved_step
from tests.app import xdo
from tests.app.conftest import pump
from tests.app.test_run_state import fake_backup
from tests.app.test_training import RUN_TIMEOUT, gui_demo_settings, on_the_demo


@pytest.fixture
def app(shared_app):
    """The file's one window, reset to a fresh one's state before each test (conftest)."""
    return shared_app


def run_json(output: Path) -> dict:
    return json.loads((output / "run.json").read_text())


# the raised maximum: enough steps that the Stop clicked a step into the continued run lands
# before it ends, on a loaded machine too
RAISED = 12


@pytest.mark.engine
def test_a_finished_run_is_continued_stopped_and_resumed_with_its_history_whole(app, tmp_path,
                                                                                real_input):
    """The journey of issue 44 item 1 through the window, clicked with the pointer: finish
    at 2, no Resume; raise Max steps to RAISED (12), Continue, Stop a step in, Resume, finish at RAISED. The
    loss curve is run.json's, each step once. About 60 s on 2 loaded cores: three real segments of the tiny
    model (the Continue and Stop are what is tested; each segment loads the model)."""
    on_the_demo(app)
    assert app.presets_bar.current.name == "demo.json" and app.binding.config.output.overwrite
    out = tmp_path / "run"
    gui_demo_settings(app, out, max_steps=2)
    app.registry.find("output.backup_every_steps").var.set("1")
    assert app.runs.start(), [str(p) for p in app.binding.problems()]
    pump(app, lambda: app.runs.worker is None, timeout=RUN_TIMEOUT)
    assert app.runs.last_result.status == "finished", app.run_panel.log_text()
    panel, resume = app.run_panel, app.run_panel.buttons["resume"]
    pump(app)
    assert resume.cget("state") == "disabled" and resume.cget("text") == "Resume"
    assert "finished at step 2" in panel.backups_label.cget("text")
    assert "finished at step 2" in panel.button_tips["resume"].text
    final = {p.name: p.read_bytes() for p in (out / "final").iterdir()}
    assert not app.runs.resume()  # pressed anyway (a stale button): refused, listed
    assert any("finished at step 2" in str(p) for p in app.problems_panel.problems)
    assert {p.name: p.read_bytes() for p in (out / "final").iterdir()} == final

    app.geometry("1200x800+0+0")
    xdo.settle(app, 0.5)
    xdo.click(app, app.tabview._segmented_button._buttons_dict["Training"])
    steps = app.registry.find("training.max_steps")          # typed, as a user raises it
    assert xdo.scroll_into_view(app, app.scroll_frames["Training"], steps.entry)
    xdo.click(app, steps.entry)
    xdo.clear_and_type(app, str(RAISED))
    pump(app, lambda: resume.cget("state") == "normal")
    assert resume.cget("text") == f"Continue for {RAISED - 2} more steps"
    resumes_from = frontend.resume_offer(out, RAISED).backup_step
    xdo.click(app, resume)
    # the run so far is shown up to where the engine resumes, as run.json holds it
    assert panel.plot.steps == list(range(1, resumes_from + 1))
    assert panel.plot.losses == run_json(out)["losses"][:resumes_from]
    pump(app, lambda: bool(panel.plot.steps) and panel.plot.steps[-1] > resumes_from,
         timeout=RUN_TIMEOUT)
    xdo.click(app, panel.buttons["stop"])                   # Stop a step into the continued run
    pump(app, lambda: app.runs.worker is None, timeout=RUN_TIMEOUT)
    assert app.runs.last_result.status == "stopped", panel.log_text()
    stopped_at = run_json(out)["step"]
    assert stopped_at < RAISED, "the Stop came too late to test it"
    assert panel.plot.steps == list(range(1, stopped_at + 1))          # whole, no step twice
    note = panel.backups_label.cget("text")
    assert "was stopped" in note and resume.cget("text") == f"Resume from step {stopped_at}"
    final_step = saved_step(out / "final")
    if final_step > stopped_at:   # the finished run's final/ was kept: the note says so
        assert f"final/ still holds the weights of step {final_step}" in note
    else:                         # the stop saved final/ (Continue went on past the end)
        assert final_step == stopped_at and "final/ still holds" not in note

    xdo.click(app, resume)                                       # Resume to the new maximum
    assert panel.plot.steps == list(range(1, stopped_at + 1))
    pump(app, lambda: app.runs.worker is None, timeout=RUN_TIMEOUT)
    assert app.runs.last_result.status == "finished" and app.runs.last_result.steps == RAISED
    record = run_json(out)
    assert record["resume_count"] == 2 and saved_step(out / "final") == RAISED
    assert record["overwrite"].startswith("not applied")  # the demo's overwrite = true
    assert "“Overwrite previous run” is not applied" in panel.log_text()  # its label
    assert panel.plot.steps == list(range(1, RAISED + 1))                       # the history stays whole
    assert panel.plot.losses == record["losses"]
    assert resume.cget("state") == "disabled"  # finished again, at the raised maximum
    assert panel.step_label.cget("text").startswith(f"{RAISED}/{RAISED} · finished · loss ")  # no ETA


def test_after_a_stopped_continue_the_run_tab_still_names_the_finished_weights(app, tmp_path,
                                                                              real_input):
    """Issue 44 item 1: a finished run (final/ at step 6) continued from an older backup and
    stopped at step 5 left a Run tab that spoke only of the stop."""
    out = tmp_path / "run"
    for step in (4, 5):
        fake_backup(out, step)
    (out / "final").mkdir()
    (out / "final" / "tempera_step.json").write_text(json.dumps({"step": 6}))
    (out / "run.json").write_text(json.dumps({"status": "stopped", "step": 5}))
    app.registry.find("output.dir").var.set(str(out))
    app.geometry("1200x800+0+0")
    xdo.settle(app, 0.3)
    xdo.click(app, app.tabview._segmented_button._buttons_dict["Run"])
    note = app.run_panel.backups_label.cget("text")
    assert "was stopped" in note and "Resume continues the newest" in note
    assert "final/ still holds the weights of step 6" in note
    assert app.run_panel.buttons["resume"].cget("text") == "Resume from step 5"
