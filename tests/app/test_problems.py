"""Invalid input is shown at the field and blocks Start with a clickable list of every problem."""
from __future__ import annotations

from app.widgets import ERROR_COLOR
from tests.app.conftest import pump


def test_invalid_entries_are_flagged_at_the_field_and_block_start(app, tmp_path):
    cfg = app.binding.config
    batch = app.registry.find("training.batch_size")
    batch.var.set("four")
    assert "whole number between 1 and 4096" in batch.error
    assert batch.error_label.cget("text").startswith("expected a whole number")  # shown
    assert batch.entry.cget("border_color") == ERROR_COLOR
    assert cfg.training.batch_size == 1                            # not applied...
    lr = app.registry.find("training.learning_rate")
    lr.var.set("5")                                                # out of range (max 1)
    assert "between 0 and 1" in lr.error
    app.registry.find("data.resolution").var.set("100")           # parses; validate rejects
    app.registry.find("components.denoiser.train").toggle.toggle()    # nothing trained
    app.registry.find("data.caption_extension").var.set("txt")    # advanced field

    assert app.runs.start() is False                           # ...and it blocks Start
    assert app.runs.worker is None
    texts = [b.cget("text") for b in app.problems_panel.buttons]
    for where in ("Training › Batch size", "Training › Learning rate", "Data › Resolution",
                  "Training › Components", "Data › Caption extension"):
        assert any(f"• {where}:" in t for t in texts), (where, texts)
    assert app.problems_panel.frame.winfo_manager() == "grid"

    resolution_button = next(b for b in app.problems_panel.buttons if "Resolution" in b.cget("text"))
    resolution_button.invoke()
    assert app.tabview.get() == "Data"
    assert app.jumped_to.path == "data.resolution"
    assert "multiple of 64" in app.jumped_to.error
    caption_button = next(b for b in app.problems_panel.buttons
                          if "Caption extension" in b.cget("text"))
    caption_button.invoke()
    assert app.registry.more_of["data.caption_extension"].expanded
    components_button = next(b for b in app.problems_panel.buttons
                             if "• Training › Components:" in b.cget("text"))
    components_button.invoke()
    assert app.tabview.get() == "Training"
    assert app.jumped_to.path.startswith("components.")

    assert app.presets_bar.save_as(tmp_path / "x.json") is None                # no silent save either
    assert not (tmp_path / "x.json").exists()
    batch.var.set("2")                                             # fixing clears the mark
    assert batch.error is None and cfg.training.batch_size == 2
    assert batch.error_label.cget("text") == ""


def test_dataset_row_problem_jumps_to_that_row(app, tmp_path):
    app.registry.find("data.datasets").add_button.invoke()
    pump(app)
    app.registry.find("data.datasets[1].path").var.set(str(tmp_path / "missing"))
    assert app.runs.start() is False
    button = next(b for b in app.problems_panel.buttons
                  if "Data › Datasets › row 2 › Folder:" in b.cget("text"))
    button.invoke()
    assert app.tabview.get() == "Data"
    assert app.jumped_to.path == "data.datasets[1].path"


def test_a_field_note_names_settings_as_the_list_does_and_one_problem_has_no_scrollbar(app):
    """The note under a listed field used the config's keys (validation.split_ratio) where the
    list says “Held-out fraction”; and a list of one problem showed a scrollbar."""
    panel = app.problems_panel
    app.registry.find("validation.every_steps").var.set("10")   # validation with no images
    assert app.runs.start() is False
    (button,) = panel.buttons
    view = app.registry.find("validation.every_steps")
    assert "“Held-out fraction” > 0" in button.cget("text")
    assert "“Held-out fraction” > 0" in view.error and "split_ratio" not in view.error
    assert "split_ratio" not in view.error_tip.text
    pump(app)
    assert not panel.list._scrollbar.winfo_ismapped()
    panel.hide()
    for path in ("training.batch_size", "data.resolution", "training.lr_warmup_steps",
                 "sampling.steps", "output.keep_checkpoints"):      # 6 problems, 4 rows shown
        app.registry.find(path).var.set("x")
    assert app.runs.start() is False and len(panel.buttons) == 6
    pump(app)
    assert panel.list._scrollbar.winfo_ismapped()
