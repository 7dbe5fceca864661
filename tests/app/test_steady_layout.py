"""What the Run tab's parts do when their content changes: the buttons after Resume stay where
they are as its text changes, and the loss curve keeps its size as samples arrive."""
from __future__ import annotations

from PIL import Image

from tests.app.conftest import pump


def test_buttons_after_resume_stay_put_as_its_text_changes(app):
    panel = app.run_panel
    resume, stop = panel.buttons["resume"], panel.buttons["stop"]
    app.tabview.set("Run")
    pump(app)
    app.update_idletasks()
    where = stop.winfo_x()
    for text in ("Resume from step 40", "Continue for 120 more steps", "Resume"):
        resume.configure(text=text)
        app.update_idletasks()
        assert stop.winfo_x() == where, text


def test_the_loss_curve_keeps_its_size_as_samples_arrive(app, tmp_path):
    panel = app.run_panel
    app.geometry("1200x800")
    app.tabview.set("Run")
    pump(app)
    app.update_idletasks()
    canvas = panel.plot.canvas
    size = (canvas.winfo_width(), canvas.winfo_height())
    for index, color in enumerate(("red", "blue")):
        image = tmp_path / f"s{index}.png"
        Image.new("RGB", (512, 512), color).save(image)
        panel.show_sample(image, f"a {color} square with a long prompt that wraps under it", 10)
        app.update_idletasks()
        assert (canvas.winfo_width(), canvas.winfo_height()) == size, index
    pump(app)
    box = panel.sample_box     # the samples and their captions fit the box they are in
    bottom = box.winfo_rooty() + box.winfo_height()
    for caption in panel.sample_captions:
        assert caption.winfo_rooty() + caption.winfo_height() <= bottom
    assert panel.sample_caption.winfo_rooty() + panel.sample_caption.winfo_height() <= bottom
