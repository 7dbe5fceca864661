"""The Data tab's caption editor, driven in a real window: open a dataset (read in a thread),
step, edit (unsaved state), save, filter, refuse an edit made elsewhere, and find and replace
with its preview and undo. The engine's own tests (tests/data/test_caption_edit.py) cover
each rule; this checks the window wires them."""
from __future__ import annotations

from PIL import Image

from tests.app.conftest import pump
from tests.data.prep.tiny_captioners import build_tiny_wd_tagger


def dataset(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for name in "abc":
        Image.new("RGB", (24, 24), (30, 90, 200)).save(folder / f"{name}.png")
    (folder / "a.txt").write_text("sks dog, red", encoding="utf-8")
    (folder / "b.txt").write_text("sks cat, red", encoding="utf-8")
    Image.new("L", (24, 24), 0).save(folder / "b_mask.png")  # empty: keeps no pixel
    (folder / "d.png").write_bytes(b"not an image")
    return folder


def wait_for_job(app, dialog) -> None:
    """Pump until the window's job has ended, however it ended; fail with what the window said.

    The job loads a model (onnxruntime's first import in this process included): on a loaded
    CI machine that takes longer than a button's reaction, so the wait is long, and a job that
    failed or was refused ends the wait at once with its message rather than a timeout.
    """
    ended = ("Not started", "Failed")
    pump(app, until=lambda: dialog.report is not None
         or dialog.progress_text.cget("text") in ended, timeout=180.0)
    assert dialog.report is not None, dialog.output.get("1.0", "end")


def test_the_caption_editor_steps_edits_saves_filters_and_replaces(make_app, tmp_path):
    answers = []  # what the unsaved-caption question answers, in turn
    app = make_app(wait_for_engine=False, ask_unsaved=lambda title, message: answers.pop(0))
    folder = dataset(tmp_path)
    editor = app.caption_editor
    app.tabview.set("Data")
    app.binding.set_text("data.datasets[0].path", str(folder))
    pump(app, until=lambda: editor.dataset.get().endswith(": data"))
    editor.open_button.invoke()
    pump(app, until=lambda: editor.listing is not None and not editor.busy)
    assert "4 images" in editor.status_text and "1 empty mask" in editor.status_text
    assert editor.image_text == "a.png"
    pump(app, until=lambda: editor.thumbnail is not None)  # drawn in a thread
    assert editor.previous.cget("state") == "disabled"
    assert editor.save_button.cget("state") == "disabled"  # nothing changed yet

    editor.text.insert("end", ", grass")
    editor._edited()
    assert editor.dirty and editor.unsaved.cget("text") == "● Unsaved changes"
    answers.append(None)  # Next with unsaved edits: Cancel keeps the image
    editor.next.invoke()
    assert editor.image_text == "a.png" and editor.dirty
    answers.append(True)  # ... and Yes saves it on the way
    editor.next.invoke()
    assert (folder / "a.txt").read_text(encoding="utf-8") == "sks dog, red, grass"
    assert editor.image_text == "b.png" and not editor.dirty
    assert "empty mask" in editor.state.cget("text")

    editor.filter.set(next(v for v in editor.filter.cget("values") if v.startswith("No caption")))
    editor._apply_filter()
    assert [editor.listing.entries[i].relative for i in editor.order] == ["c.png", "d.png"]
    editor.text.insert("1.0", "a caption at last")
    editor._edited()
    assert editor.save()  # c.txt is made; the menu counts it
    assert (folder / "c.txt").read_text(encoding="utf-8") == "a caption at last"
    assert editor.filter.get() == "No caption file (1)"
    editor.step(1)
    assert editor.image_text == "d.png" and editor.thumbnail is None
    assert "unreadable" in editor.state.cget("text")
    editor.filter.set(next(v for v in editor.filter.cget("values") if v.startswith("All")))
    editor._apply_filter()

    (folder / "a.txt").write_text("edited elsewhere", encoding="utf-8")  # behind its back
    editor.text.insert("end", "!")
    editor._edited()
    assert not editor.save()
    assert "changed on disk" in editor.status_text and editor.dirty
    assert (folder / "a.txt").read_text(encoding="utf-8") == "edited elsewhere"
    editor.revert_button.invoke()
    assert not editor.dirty
    editor.open_button.invoke()  # read again: the edit made elsewhere is shown
    pump(app, until=lambda: not editor.busy and editor.text.get("1.0", "end-1c")
         == "edited elsewhere")

    editor.find.insert(0, "red")
    editor.replacement.insert(0, "blue")
    assert editor.replace_button.cget("state") == "disabled"  # preview first
    editor.preview_button.invoke()
    report = editor.report.get("1.0", "end")
    assert "1 match(es) of 'red' in 1 caption file(s)" in report  # a.txt no longer says red
    assert "b.png: sks cat, red → sks cat, blue" in report
    assert (folder / "b.txt").read_text(encoding="utf-8") == "sks cat, red"  # only a preview
    editor.replace_button.invoke()
    pump(app, until=lambda: not editor.busy)
    assert (folder / "b.txt").read_text(encoding="utf-8") == "sks cat, blue"
    editor.undo_button.invoke()
    pump(app, until=lambda: not editor.busy and editor.last_backup is None
         and editor.listing.entries[1].caption == "sks cat, red")
    assert (folder / "b.txt").read_text(encoding="utf-8") == "sks cat, red"

    # Caption images…: the tool's window for this dataset's folder, built from its settings
    tagger = build_tiny_wd_tagger(tmp_path / "tagger")
    editor.prep_buttons["caption"].invoke()
    dialog = editor.prep_windows["caption"]
    assert dialog.folder.get() == str(folder)
    dialog.preset_menu.set("tags")
    dialog.apply_preset("tags")  # the tagger, its model and thresholds
    assert dialog.variables["captioner"].get() == "wd-tagger"
    dialog.inputs["model"].delete(0, "end")
    dialog.inputs["model"].insert(0, str(tagger))
    dialog.variables["existing"].set("skip")
    dialog.inputs["batch_size"].delete(0, "end")
    dialog.inputs["batch_size"].insert(0, "two")
    dialog.start_button.invoke()  # a setting that cannot be read is named, nothing runs
    assert "Batch size: 'two' is not a whole number" in dialog.output.get("1.0", "end")
    dialog.inputs["batch_size"].delete(0, "end")
    dialog.inputs["batch_size"].insert(0, "2")
    dialog.busy_reason = lambda: "a training run is running"
    dialog.start_button.invoke()  # not beside a training run
    assert "Not started: a training run is running" in dialog.output.get("1.0", "end")
    dialog.busy_reason = lambda: None
    dialog.start_button.invoke()
    wait_for_job(app, dialog)
    assert dialog.report.status == "finished"
    assert "1 girl" not in (folder / "c.txt").read_text(encoding="utf-8")  # had a caption
    written = [p.name for p in dialog.report.written]
    assert written == [], written  # every readable image had a caption: skip leaves them
    assert "d.png" in dialog.output.get("1.0", "end")  # the unreadable image, named
    (folder / "c.txt").unlink()
    dialog.start_button.invoke()
    wait_for_job(app, dialog)
    assert dialog.report.written
    assert (folder / "c.txt").read_text(encoding="utf-8").startswith("1girl")
    assert dialog.progress_text.cget("text").startswith("caption job finished")
    dialog.close_button.invoke()
    pump(app, until=lambda: not dialog.winfo_exists())
    assert app.guard.violations == []
