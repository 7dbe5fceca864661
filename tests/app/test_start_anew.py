"""Start in an output folder that holds a finished run, with *Overwrite previous run* on (the
demo's default): Start asks first, naming what would go, or starts in a numbered folder beside
it; the Run tab's note then says what the folder holds, read from the disk."""
from __future__ import annotations

import threading
from types import SimpleNamespace

from app.replace_dialog import NEW_FOLDER, REPLACE, ReplaceDialog
from modules.train.setup.start import clear_previous_run
from tests.app.conftest import pump
from tests.train.test_previous_run import finished_run


def _folder_with_a_finished_run(app, tmp_path):
    output = tmp_path / "lora"
    finished_run(output, step=16)
    app.binding.set_value("output.overwrite", True)
    app.registry.find("output.dir").var.set(str(output))
    pump(app)
    assert "finished at step 16" in app.run_panel.backups_label.cget("text")
    return output


def test_start_asks_before_it_replaces_a_finished_run_and_the_note_follows_the_disk(app,
                                                                                   tmp_path):
    output = _folder_with_a_finished_run(app, tmp_path)
    asked, answers, trained_into = [], [None], []
    release = threading.Event()

    def ask(message, folder):
        asked.append((message, folder))
        return answers[0]

    def fake_train(config, callbacks, commands):  # clears the folder as the engine does
        trained_into.append(config.output.dir)
        cleared = clear_previous_run(output)
        callbacks.on_status("output.overwrite: removed the previous run's " + ", ".join(cleared))
        release.wait(30)
        (output / "run.json").write_text('{"status": "stopped", "step": 2}')
        return SimpleNamespace(status="stopped", steps=2, output_dir=output)

    app.runs.ask_replace, app.runs.train_fn = ask, fake_train
    assert not app.runs.start()                      # cancelled: nothing starts, nothing goes
    (message, folder), = asked
    assert message.startswith(f"The run in {output} finished at step 16.")
    assert "final/ (the weights of step 16" in message and "3 backups (step 5, 10, 16)" in message
    assert "3 samples" in message and folder == tmp_path / "lora-2"
    assert app.runs.worker is None and len(list((output / "backups").iterdir())) == 3
    assert "the run in" in app.run_panel.status_text and "is kept" in app.run_panel.status_text

    answers[0] = REPLACE
    assert app.runs.start()
    note = app.run_panel.backups_label
    try:
        pump(app, lambda: not (output / "backups").exists()
             and "No backup in it yet" in note.cget("text"))
        text = note.cget("text")   # no promise about final/ of a run that is being replaced
        assert "finished at step 16" not in text and "step 5" not in text
        assert "final/ holds the weights of step 16 until this run saves" in text
    finally:
        release.set()
    pump(app, lambda: app.runs.worker is None)
    assert trained_into == [str(output)]
    assert "No backups in the output folder" in note.cget("text")   # read again at the end


def test_start_in_a_new_folder_keeps_the_run_and_the_dialog_names_what_would_go(make_app,
                                                                                tmp_path):
    """The real dialog, answered from inside its wait. Over 10 s on a loaded machine: its own
    window (the real dialog needs the default asker) waits for torch to load, as Start does."""
    app = make_app(ask_replace=None)                # the real dialog
    output = _folder_with_a_finished_run(app, tmp_path)
    trained_into, shown = [], []

    def fake_train(config, callbacks, commands):
        trained_into.append(config.output.dir)
        return SimpleNamespace(status="finished", steps=1, output_dir=config.output.dir)

    def answer():  # runs inside the dialog's wait: press its "Start in lora-2/"
        dialogs = [w for w in app.winfo_children() if isinstance(w, ReplaceDialog)]
        if not dialogs or not dialogs[0].winfo_viewable():
            app.after(20, answer)
            return
        dialog = dialogs[0]
        shown.append(dialog.message.cget("text"))
        assert dialog.buttons[NEW_FOLDER].cget("text") == "Start in lora-2/"
        dialog.buttons[NEW_FOLDER].invoke()

    app.runs.train_fn = fake_train
    app.after(20, answer)
    assert app.runs.start()
    pump(app, lambda: app.runs.worker is None)
    assert "3 backups (step 5, 10, 16)" in shown[0] and "final/ (the weights of step 16" in shown[0]
    assert trained_into == [str(tmp_path / "lora-2")]
    assert app.binding.config.output.dir == str(tmp_path / "lora-2")   # the form says so too
    assert len(list((output / "backups").iterdir())) == 3 and (output / "final").is_dir()
