"""What a first-time user tripped over (issue 22): error lines that moved the form, a problem list
that did not follow the edits, raw enum names, controls that looked enabled when they were not,
stale status lines, the mouse wheel stopping over text boxes, a half-drawn first paint and
Tk's own file dialog on Linux."""
from __future__ import annotations

import os
import stat
import threading
from types import SimpleNamespace

import pytest

from app.fields import iter_fields
from app.labels import ENUM_LABELS, enum_label
from app.widgets import DISABLED_TEXT, EnumView, MultiEnumView, ReadOnlyView
from modules.config import Config
from modules.config.schema import CompileBackend
from tests.app.conftest import pump


@pytest.fixture
def app(shared_app):
    """The file's one window, reset to a fresh one's state before each test (conftest)."""
    return shared_app


def settled(app):
    pump(app)
    app.update_idletasks()
    pump(app)


def in_view(scroll, widget) -> float:
    """`widget`'s top in pixels below the top of what `scroll`'s page shows, in the canvas's
    own coordinates (the view's top, `canvasy(0)`, and the widget's offset in the page), which
    Tk keeps whether or not the window is mapped at that moment: screen positions are not moved
    while a canvas is unmapped, and a check on them once read stale ones on CI (the view had
    moved, the numbers had not)."""
    return widget.winfo_rooty() - scroll.winfo_rooty() - scroll._parent_canvas.canvasy(0)


def test_an_error_line_moves_no_field(app):
    app.tabview.set("Training")
    settled(app)
    batch = app.registry.find("training.batch_size")
    below = app.registry.find("training.gradient_accumulation")
    right = app.registry.find("components.denoiser.learning_rate")
    before = (below.frame.winfo_rooty(), right.frame.winfo_rootx(), batch.frame.winfo_width())
    batch.var.set("four")
    settled(app)
    assert batch.error_label.cget("text").startswith("expected a whole number")
    after = (below.frame.winfo_rooty(), right.frame.winfo_rootx(), batch.frame.winfo_width())
    assert after == before
    long = "expected " + "a very particular value, " * 20 + "got 'four'"
    batch.show_error(long)
    settled(app)
    shown = batch.error_label.cget("text")
    assert shown.endswith("…") and len(shown) < len(long)            # cut to the field...
    assert batch.error_tip.text == long                              # ...whole on hover
    assert long in batch.tooltips[-1].text
    assert (below.frame.winfo_rooty(), right.frame.winfo_rootx(),
            batch.frame.winfo_width()) == before


def test_the_problem_list_follows_the_edits_and_closes_when_all_are_fixed(app):
    batch = app.registry.find("training.batch_size")
    resolution = app.registry.find("data.resolution")
    batch.var.set("four")
    resolution.var.set("100")
    assert not app.runs.start()
    assert len(app.problems_panel.buttons) == 2
    assert "expected a multiple of 64" in resolution.error           # marked at the field too
    batch.var.set("2")
    pump(app, lambda: len(app.problems_panel.buttons) == 1)
    assert "Resolution" in app.problems_panel.buttons[0].cget("text")
    resolution.var.set("120")                                        # still not a multiple
    pump(app, lambda: resolution.error is not None and "multiple of 64" in resolution.error)
    resolution.var.set("12a")                                        # typing goes on...
    pump(app, lambda: any("12a" in b.cget("text") for b in app.problems_panel.buttons))
    assert resolution.var.get() == "12a"                             # ...and is not undone
    resolution.var.set("128")
    pump(app, lambda: app.problems_panel.frame.winfo_manager() == "")
    assert resolution.error is None
    assert app.run_panel.status_text == "Every listed problem is fixed."


def test_a_problem_click_scrolls_its_field_into_view(app):
    app.geometry("1024x700")
    settled(app)
    app.registry.find("sampling.seed").var.set("x")                   # low on a long tab
    app.tabview.set("General")
    assert not app.runs.start()
    button = next(b for b in app.problems_panel.buttons if "Sampling › Sampling seed:" in b.cget("text"))
    button.invoke()
    settled(app)
    view = app.jumped_to
    scroll = app.scroll_frames["Sampling"]
    top = in_view(scroll, view.frame)
    assert 0 <= top and top + 20 <= scroll._parent_canvas.winfo_height()
    assert app.focus_get() is view.entry._entry


def test_option_menus_show_labels_never_raw_names(app):
    for info in iter_fields(Config):
        if info.enum_type is not None:
            for member in info.enum_type:
                assert member in ENUM_LABELS.get(info.enum_type, {}), (
                    f"{info.dotted_path}: no label for {member}")
    for view in app.registry.all_views():
        if isinstance(view, EnumView):
            assert view.menu.get() == enum_label(view.binding.get(view.path))
            assert set(view.menu.cget("values")) == {enum_label(m) for m in view.info.enum_type}
        if isinstance(view, MultiEnumView):
            assert all(box.cget("text") == enum_label(m) for m, box in view.boxes.items())
    assert app.registry.find("general.device").menu.get() == "Auto (GPU if any)"
    assert app.registry.find("compile.dynamic").menu.get() == "Automatic"   # both AUTO
    backend = app.registry.find("compile.backend")
    backend.pick("AOT_EAGER")                   # a value's name still works (scripts, tests)
    assert app.binding.config.compile.backend == CompileBackend.AOT_EAGER
    assert backend.menu.get() == "AOT eager (debug)"


def test_config_version_is_shown_not_edited_and_model_type_is_in_one_place(app):
    version = app.registry.find("config_version")
    assert isinstance(version, ReadOnlyView)
    assert version.value_label.cget("text") == str(app.binding.config.config_version)
    assert len(app.registry.views["model.type"]) == 1
    assert app.registry.tab_of["model.type"] == "Model"


def test_compile_details_look_disabled_under_backend_none(app):
    panel = app.compile_panel
    panel.backend.pick(CompileBackend.NONE)
    strict = app.registry.find("compile.strict")
    cache = app.registry.find("compile.cache_dir")
    assert strict.toggle.cget("state") == "disabled" and cache.entry.cget("state") == "disabled"
    assert strict.label.cget("text_color") == DISABLED_TEXT
    assert cache.entry.cget("text_color") == DISABLED_TEXT
    assert "the backend is None (eager)" in strict.tooltips[0].text
    panel.backend.pick(CompileBackend.INDUCTOR)
    assert strict.toggle.cget("state") == "normal" and strict.label.cget("text_color") != (
        DISABLED_TEXT)
    assert cache.entry.cget("text_color") != DISABLED_TEXT


def test_start_is_greyed_while_a_benchmark_runs(app, tmp_path):
    release = threading.Event()

    def bench(config, **kwargs):
        release.wait(30)
        raise RuntimeError("this test's benchmark ends here")

    app.benchmark.bench_fn = bench
    app.registry.find("output.dir").var.set(str(tmp_path / "out"))
    assert app.benchmark.start()
    start = app.run_panel.buttons["start"]
    assert start.cget("state") == "disabled"
    assert start.cget("fg_color") != app.run_panel.buttons["open_output"].cget("fg_color")
    assert "a benchmark is running" in app.run_panel.button_tips["start"].text
    release.set()
    pump(app, lambda: start.cget("state") == "normal", timeout=30)
    assert start.cget("fg_color") == ("#2e7d32", "#2e7d32")           # its own green again


def test_status_line_is_one_line_and_its_error_goes_with_the_next_edit(app):
    panel = app.run_panel
    long = "Could not do the thing: " + "a long reason, " * 40 + "the end."
    panel.set_status(long, error=True)
    pump(app)
    assert panel.status.cget("text").endswith("…") and "\n" not in panel.status.cget("text")
    assert panel.status_tip.text == long and panel.status_text == long
    app.registry.find("training.max_steps").var.set("12")            # the next edit
    assert panel.status_text == "Ready." and not panel.status_error
    panel.set_status("Loaded the demo.")                              # not an error: it stays
    app.registry.find("training.max_steps").var.set("13")
    assert panel.status_text == "Loaded the demo."


def test_tensorboard_shows_its_address_on_its_button(app, monkeypatch):
    from app import external
    opened = []
    monkeypatch.setattr(external, "start_tensorboard",
                        lambda logdir: SimpleNamespace(poll=lambda: None, terminate=lambda: None))
    monkeypatch.setattr(external, "open_url", opened.append)
    button = app.run_panel.buttons["tensorboard"]
    button.invoke()
    assert button.cget("text") == "Open 127.0.0.1:6006"
    assert "127.0.0.1:6006" in app.run_panel.status_text
    button.invoke()
    assert opened == ["http://127.0.0.1:6006"]
    app.runs.tensorboard = None


def test_the_wheel_over_a_read_only_box_scrolls_the_page(app):
    app.geometry("1024x700")
    app.tabview.set("Advanced Options")
    settled(app)
    canvas = app.scroll_frames["Advanced Options"]._parent_canvas
    report = app.compile_panel.report._textbox
    assert canvas.yview()[0] == 0.0
    report.event_generate("<Button-5>", x=5, y=5)                   # wheel down, short report
    pump(app)
    assert canvas.yview()[0] > 0.0


def curtain_on_top(app) -> bool:
    """The curtain is shown and stacked above every other part of the window."""
    parts = [child for child in app.winfo_children() if child.winfo_toplevel() is app]
    return app.curtain.shown and parts[-1] is app.curtain.frame  # Tk lists them lowest first


def test_the_form_is_built_under_a_curtain_that_says_what_it_builds(display, tmp_path):
    """The window is on screen at once, covered by a line naming the tab being built, so the
    half-built form (an empty grey frame, buttons without labels) is never seen; once every
    tab is built and fitted it is uncovered."""
    from app.window import TemperaApp
    seen = []

    class Watched(TemperaApp):
        def _build_tabs(self):
            seen.append((self.state(), self.winfo_viewable(), curtain_on_top(self)))
            super()._build_tabs()
            seen.append((self.curtain.text, curtain_on_top(self)))

    app = Watched(settings_path=tmp_path / "ui.json", confirm=lambda t, m: True)
    try:
        assert seen[0] == ("normal", 1, True)
        assert seen[1] == ("Tempera is starting: building the Advanced Options tab…", True)
        assert not app.curtain.shown and app.state() == "normal"
        assert app.run_panel.buttons["start"].winfo_viewable()
    finally:
        app._finish_close()


def test_save_as_uses_the_desktop_chooser_when_there_is_one(app, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    target = tmp_path / "mine"                                        # no extension typed
    zenity = bin_dir / "zenity"
    zenity.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "args"}\necho {target}\n')
    zenity.chmod(zenity.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("TEMPERA_FILE_DIALOG", raising=False)
    written = app.presets_bar.save_as()
    assert written == tmp_path / "mine.json" and written.is_file()
    args = (tmp_path / "args").read_text()
    assert "--save" in args and "--confirm-overwrite" in args and "*.json" in args

    zenity.write_text("#!/bin/sh\nexit 1\n")                          # cancelled
    assert app.presets_bar.save_as() is None


def test_chooser_command_lines():
    from app.dialogs import chooser_command
    assert chooser_command("kdialog", "open", "Base model", "/m/", ("Model", ("*.safetensors",))
                           ) == ["kdialog", "--title", "Base model", "--getopenfilename", "/m/",
                                 "*.safetensors|Model"]
    assert chooser_command("zenity", "folder", "Dataset", "/d/", None) == [
        "zenity", "--file-selection", "--title=Dataset", "--filename=/d/", "--directory"]


def test_component_section_titles_are_greyed(app):
    title = app.registry.section_titles["components.text_encoder_2"]
    assert title.cget("text_color") == DISABLED_TEXT


def test_more_options_line_up_with_the_fields_above(app):
    app.tabview.set("General")
    more = app.registry.more_of["general.cache_dir"]
    more.expand()
    settled(app)

    def columns(hidden: bool) -> set[tuple[int, int]]:
        return {(v.frame.winfo_rootx(), v.frame.winfo_width())
                for path, views in app.registry.views.items() for v in views
                if app.registry.tab_of[path] == "General"
                and (app.registry.more_of.get(path) is more) == hidden}

    assert len(columns(False)) == 2 and columns(True) == columns(False)
    more.collapse()
    settled(app)
    assert not app.registry.find("general.cache_dir").frame.winfo_ismapped()


def test_the_two_cache_folders_say_where_empty_puts_them(app, tmp_path):
    from modules.paths import default_cache_dir
    general = app.registry.find("general.cache_dir")
    compile_cache = app.registry.find("compile.cache_dir")
    assert general.error_label.cget("text") == f"empty: {default_cache_dir()}"
    assert str(default_cache_dir() / "compile") in compile_cache.error_tip.text
    general.var.set(str(tmp_path / "c"))
    assert general.error_label.cget("text") == ""
    assert str(tmp_path / "c" / "compile") in compile_cache.error_tip.text
    compile_cache.var.set(str(tmp_path / "cc"))
    assert compile_cache.error_tip.text == ""
    # the other field hint: Frozen weights storage shows the 8-bit storages once the engine is
    # loaded, one line each (what it saves and costs, or why this machine cannot run it)
    from modules.frontend import storage_summaries
    storage = app.registry.view("model.weight_storage")
    lines = storage_summaries(app.binding.config)
    assert storage.hint == " | ".join(lines) == storage.error_tip.text
    assert lines[0].startswith("INT8: ") and lines[1].startswith("FLOAT8: ")
    assert lines[2].startswith("W8A8: ")  # int8 matmuls: this CPU runs them


def test_a_ui_scale_change_happens_under_the_curtain_stacks_columns_and_invents_no_errors(
        app, monkeypatch):
    """One change to 150 % and back (each redraws every widget: seconds), three checks.
    customtkinter redraws every widget on a scale change, in Python, seconds on a loaded
    machine, with buttons drawn before their labels: the window is covered meanwhile. The
    same window with larger widgets stacks the columns that no longer fit. A problem list the
    user closed stays closed, and no error is invented."""
    app.registry.find("data.resolution").var.set("100")
    assert not app.runs.start()
    app.problems_panel.hide()                                         # the user closed the list
    app.registry.find("data.resolution").var.set("128")
    more = app.registry.more_of["general.cache_dir"]
    more.expand()
    more.collapse()

    seed = app.registry.find("training.seed")
    app.tabview.set("General")
    app.geometry("1280x860")
    settled(app)
    app.sizing.fit_columns()
    settled(app)
    assert not app.registry.layouts[0].stacked
    side_by_side_y = seed.frame.winfo_rooty()

    def closed_list_and_no_errors():
        settled(app)
        wait(app)          # past the problem list's re-check delay
        assert app.problems_panel.frame.winfo_manager() == ""
        assert not more.expanded and all(b.winfo_manager() == "" for b in more.bodies)
        assert app.binding.errors == {}
        assert [v.path for v in app.registry.all_views() if v.error] == []

    during = []
    fit = app.sizing.fit_columns
    monkeypatch.setattr(app.sizing, "fit_columns", lambda: (
        during.append((app.curtain.text, curtain_on_top(app))), fit()))
    app.sizing.scale_menu._dropdown_callback("150%")                 # the same window, larger widgets
    assert during == [("Changing the UI scale to 150%…", True)]
    assert not app.curtain.shown and app.sizing.scale_menu.winfo_viewable()
    settled(app)
    right_edge = app.winfo_rootx() + app.winfo_width()
    assert seed.frame.winfo_rootx() + seed.frame.winfo_width() <= right_edge
    assert seed.frame.winfo_rooty() > side_by_side_y          # below the left column now
    closed_list_and_no_errors()

    app.sizing.scale_menu._dropdown_callback("100%")
    settled(app)
    assert seed.frame.winfo_rooty() == side_by_side_y
    closed_list_and_no_errors()


def wait(app, seconds: float = 0.6) -> None:
    import time
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.update()
        time.sleep(0.02)


def test_the_save_refusal_list_follows_the_edits_too(app, tmp_path):
    batch = app.registry.find("training.batch_size")
    batch.var.set("four")
    assert app.presets_bar.save_as(tmp_path / "p.json") is None
    assert app.problems_panel.title.cget("text") == "Fix these fields before saving"
    batch.var.set("3")
    pump(app, lambda: app.problems_panel.frame.winfo_manager() == "")
    assert app.presets_bar.save_as(tmp_path / "p.json") == tmp_path / "p.json"


def test_stacked_columns_leave_no_empty_gap(app):
    """The Model tab has one section: stacked, its empty second column must take no room."""
    app.tabview.set("Model")
    last = app.registry.find("model.train_dtype")
    layout = next(layout for layout in app.registry.layouts
                  if any(str(last.frame).startswith(str(column))
                         for band, _ in layout.items if isinstance(band, list)
                         for column in band))
    more = next(m for path, m in app.registry.more_of.items()
                if app.registry.tab_of[path] == "Model")
    for stacked in (True, False):
        layout.arrange(stacked=stacked)
        settled(app)
        gap = more.button.winfo_rooty() - (last.frame.winfo_rooty() + last.frame.winfo_height())
        assert 0 <= gap < 60, (stacked, gap)


def test_opening_more_options_pushes_no_field_past_the_right_edge(app):
    """The More fields share the grid's columns with the fields above: a wide one used to widen
    the left column and push the right one past the edge of a 1024-pixel window."""
    app.geometry("1000x660")
    settled(app)
    app.sizing.fit_columns()
    settled(app)
    right_edge = app.winfo_rootx() + app.winfo_width()
    for more in set(app.registry.more_of.values()):
        tab = next(t for p, t in app.registry.tab_of.items() if app.registry.more_of.get(p) is more)
        app.tabview.set(tab)
        more.expand()
        settled(app)
        out = [v.path for v in app.registry.all_views()
               if app.registry.tab_of.get(app.registry.top_path(v.path)) == tab
               and v.frame.winfo_ismapped()
               and v.frame.winfo_rootx() + v.frame.winfo_width() > right_edge]
        more.collapse()
        assert out == [], (tab, out)


def test_a_click_on_more_options_at_the_bottom_of_the_page_shows_what_it_opened(app):
    app.tabview.set("Training")
    settled(app)
    more = next(m for p, m in app.registry.more_of.items() if app.registry.tab_of[p] == "Training")
    scroll = app.scroll_frames["Training"]
    canvas = scroll._parent_canvas

    canvas.yview_moveto(1.0)                                    # scrolled to the end, as a user
    settled(app)
    assert in_view(scroll, more.button) > canvas.winfo_height() / 2
    more.button.invoke()
    settled(app)
    first = min(more.bodies, key=lambda body: body.winfo_rooty())
    assert 0 <= in_view(scroll, more.button) and in_view(scroll, first) + 40 < canvas.winfo_height()
    more.button.invoke()                                        # closing moves nothing
    settled(app)
    assert not more.expanded
