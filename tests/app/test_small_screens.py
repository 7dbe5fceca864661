"""Issue 44 item 7: the window on small screens (a 1366x768 laptop at 150 %, a 1024x700 one),
with real pointer input (xdotool) where the trap is about input."""
from __future__ import annotations

import json


from tests.app import xdo
from tests.app.test_run_state import fake_backup


def visible_fields(app, tab: str) -> int:
    """How many of the tab's fields are wholly inside its page (the part on screen)."""
    canvas = app.scroll_frames[tab]._parent_canvas
    top, bottom = canvas.winfo_rooty(), canvas.winfo_rooty() + canvas.winfo_height()
    return sum(1 for view in app.registry.all_views()
               if app.registry.tab_of.get(view.path) == tab and view.frame.winfo_ismapped()
               and top <= view.frame.winfo_rooty()
               and view.frame.winfo_rooty() + view.frame.winfo_height() <= bottom)


def test_a_1366x768_screen_at_150_percent_keeps_room_for_the_form(app, real_input):
    """The window as it opens on that screen (1280x705 on screen): the run bar is compact and
    one notch of the wheel moves the page by three lines of the scaled page, not 30 px."""
    try:
        app.sizing.scale_chosen("150%")
        app.geometry("853x470+0+0")  # customtkinter's unscaled units: 1280x705 on screen
        xdo.settle(app, 0.8)
        assert abs(app.winfo_height() - 705) <= 2
        bar = app.run_panel.bar
        assert app.run_panel.compact and bar.winfo_height() <= 130  # it was 195 px
        assert visible_fields(app, "General") >= 4                  # it was 3
        page = app.scroll_frames["General"]
        canvas = page._parent_canvas
        xdo.move_to(*xdo.centre(canvas))
        before = page.winfo_children()[0].winfo_rooty()
        xdo._xdotool("click", "5")                                   # one notch down
        xdo.settle(app, 0.3)
        moved = before - page.winfo_children()[0].winfo_rooty()
        assert moved == 90, moved                                     # 60 px x 150 %
        app.geometry("853x700+0+0")                                  # a taller window: the full bar
        xdo.settle(app, 0.8)
        assert not app.run_panel.compact
    finally:
        app.sizing.scale_chosen("100%")


def test_the_run_tabs_resume_note_is_whole_on_a_1024x700_screen(app, tmp_path, real_input):
    output = tmp_path / "out"
    fake_backup(output, 2)
    fake_backup(output, 3)
    (output / "run.json").write_text(json.dumps({"status": "finished", "step": 4}))
    app.registry.find("output.dir").var.set(str(output))
    app.registry.find("training.max_steps").var.set("8")
    app.geometry("983x644+0+0")  # the window on a 1024x700 screen
    xdo.settle(app, 0.5)
    xdo.click(app, app.tabview._segmented_button._buttons_dict["Run"])
    xdo.settle(app, 0.5)
    note = app.run_panel.backups_label
    text = note.cget("text")
    assert "finished at step 4" in text and "Continue trains" in text
    inner = note._label  # the tk label inside the CTkLabel: wrapped text, all of it shown
    assert inner.winfo_height() >= inner.winfo_reqheight() and inner.winfo_reqheight() > 30
    assert note.winfo_rootx() + note.winfo_width() <= app.winfo_rootx() + app.winfo_width()
