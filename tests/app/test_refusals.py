"""Every refusal reaches the window: a value the loader refuses (issue 54 item 1: a W&B API key
pasted into *W&B entity*) is listed and marked at its field by Start, Save as… and Check
compilation, never only printed on the terminal, and the key is never written or echoed."""
from __future__ import annotations

from modules.config import ConfigError, Problem
from tests.app.conftest import pump

KEY = "0123456789abcdef" * 2 + "01234567"   # shaped like a W&B API key (40 hex digits)


def paste_key(app) -> None:
    app.registry.find("logging.wandb_entity").var.set(KEY)
    assert app.binding.config.logging.wandb_entity == KEY      # taken as text, then refused


def listed_and_marked(app, path: str = "logging.wandb_entity") -> None:
    panel = app.problems_panel
    assert panel.is_open and path in [p.path for p in panel.problems]
    assert app.registry.find(path).error                         # red at the field
    assert app.run_panel.status_error and app.run_panel.status_text != "Ready."
    shown = [panel.title.cget("text"), app.run_panel.status_text, app.run_panel.log_text()]
    shown += [button.cget("text") for button in panel.buttons]
    assert not any(KEY in text for text in shown)                # the key is never echoed


def test_start_lists_a_key_pasted_into_a_wandb_field(app, tmp_path):
    app.registry.find("output.dir").var.set(str(tmp_path / "out"))
    paste_key(app)
    assert not app.runs.start()
    listed_and_marked(app)
    assert app.runs.worker is None
    assert "Cannot start" in app.run_panel.status_text


def test_save_as_lists_the_key_and_writes_nothing(app, tmp_path):
    asked = []
    app.presets_bar.ask_save_path = lambda initial: asked.append(initial) or str(
        tmp_path / "mine.json")
    paste_key(app)
    assert app.presets_bar.save_as() is None
    listed_and_marked(app)
    assert "Not saved" in app.run_panel.status_text
    assert asked == [] and not (tmp_path / "mine.json").exists()  # no name asked in vain
    app.registry.find("logging.wandb_entity").var.set("my-team")   # fixed: the list goes
    pump(app, lambda: not app.problems_panel.is_open)
    assert app.presets_bar.save_as() == tmp_path / "mine.json"
    assert KEY not in (tmp_path / "mine.json").read_text()


def test_check_compilation_lists_the_key(app):
    paste_key(app)
    app.compile_panel.check_button.invoke()
    assert app.problems_panel.is_open
    assert "logging.wandb_entity" in [p.path for p in app.problems_panel.problems]
    assert not app.runs.checking


def test_a_refusal_raised_in_any_callback_is_listed_at_its_field(app):
    """Whatever check raises ConfigError inside a button's command or an after(), the window
    lists it (Tk's default only printed it on the terminal)."""
    def refuse() -> None:
        raise ConfigError([Problem("training.batch_size", "a batch this machine fits", "512",
                                   "refused by a check")])

    app.after(0, refuse)
    pump(app, lambda: app.problems_panel.is_open)
    listed_and_marked(app, "training.batch_size")
    assert "Refused: 1 problem(s)" in app.run_panel.status_text
