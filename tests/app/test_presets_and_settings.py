"""Preset picker, built-in presets protection, and the remembered GUI settings."""
from __future__ import annotations

import json
import shutil

from app.presets import list_presets
from app.settings import UISettings, load_settings
from app.window_size import apply_scaling
from tests.app.conftest import REPO


def test_presets_are_listed_grouped_by_folder_then_the_users(tmp_path):
    builtin, mine = tmp_path / "builtin", tmp_path / "mine"
    for path in (builtin / "demo.json", builtin / "sd15" / "lora.json",
                 builtin / "sdxl" / "full.json", mine / "cats.json"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    labels = [(p.label, p.builtin) for p in list_presets(builtin, mine)]
    assert labels == [("demo", True), ("sd15 / lora", True), ("sdxl / full", True),
                      ("mine / cats", False)]


def test_built_in_presets_are_never_silently_overwritten(make_app, tmp_path):
    builtin = tmp_path / "training_presets"
    builtin.mkdir()
    shutil.copy(REPO / "training_presets" / "demo.json", builtin / "demo.json")
    original = (builtin / "demo.json").read_text()
    answers, asked_paths = [], []
    app = make_app(builtin_presets_dir=builtin, confirm=lambda t, m: answers.pop(0),
                   ask_save_path=lambda folder: asked_paths.append(folder) or None)
    assert app.presets_bar.current == builtin / "demo.json"
    assert app.presets_bar.menu.get() == "demo"
    app.registry.find("training.max_steps").var.set("7")

    assert app.presets_bar.save() is None                       # built-in: Save goes to "Save as…"
    assert asked_paths == [app.settings.user_presets_path]
    assert app.presets_bar.save_as(builtin / "demo.json") is None   # refused outright
    assert "built-in preset" in app.run_panel.status.cget("text")
    assert (builtin / "demo.json").read_text() == original
    answers.append(False)
    assert app.presets_bar.save_as(builtin / "new.json") is None    # asked, declined
    assert not (builtin / "new.json").exists()
    answers.append(True)
    assert app.presets_bar.save_as(builtin / "new.json") == builtin / "new.json"

    mine = tmp_path / "mine.json"
    assert app.presets_bar.save_as(mine) == mine
    assert json.loads(mine.read_text())["training"]["max_steps"] == 7
    app.registry.find("training.max_steps").var.set("8")
    assert app.presets_bar.save() == mine                       # a user preset is saved in place
    assert json.loads(mine.read_text())["training"]["max_steps"] == 8


def test_picker_loads_the_chosen_preset(make_app, tmp_path):
    builtin = tmp_path / "presets"
    (builtin / "group").mkdir(parents=True)
    (builtin / "group" / "a.json").write_text(json.dumps({"training": {"max_steps": 11}}))
    (builtin / "b.json").write_text(json.dumps({"training": {"max_steps": 22}}))
    app = make_app(builtin_presets_dir=builtin)
    assert app.presets_bar.menu.cget("values") == ["b", "group / a"]
    app.presets_bar.menu.set("group / a")
    assert app.presets_bar.load_selected()
    assert app.binding.config.training.max_steps == 11
    assert app.registry.find("training.max_steps").var.get() == "11"


def test_window_size_scale_and_last_preset_are_remembered(make_app, tmp_path):
    settings = tmp_path / "ui-settings.json"
    try:
        app = make_app(settings_path=settings)
        app.geometry("1100x720")
        app.update()
        # (customtkinter pins the window size for a second after a scale change, so resize first)
        app.sizing.scale_menu._dropdown_callback("125%")
        assert load_settings(settings)[0].scaling == 1.25
        app.update()
        app._finish_close()
        saved, warning = load_settings(settings)
        assert warning is None
        # the window kept its 1100x720 on screen: at 125% that is 880x576 in customtkinter's
        # (unscaled) units, which is what is saved and restored
        assert saved.geometry.startswith("880x576")
        assert saved.last_preset.endswith("demo.json")
        again = make_app(settings_path=settings)
        assert again.sizing.scale_menu.get() == "125%"
        assert again.settings.geometry.startswith("880x576")
        again.update()
        assert abs(again.winfo_width() - 1100) <= 30
    finally:
        apply_scaling(1.0)


def test_unreadable_settings_are_reported_not_fatal(make_app, tmp_path):
    settings = tmp_path / "ui.json"
    settings.write_text("{not json")
    app = make_app(settings_path=settings)
    assert "ignored unreadable GUI settings" in app.run_panel.log_text()
    assert app.settings == UISettings(last_preset=app.settings.last_preset)


def test_the_settings_and_presets_live_in_xdg_config_home(make_app, tmp_path, monkeypatch):
    """Issue 44 item 7: $XDG_CONFIG_HOME names the config folder (ui.json, the user's
    presets); the window kept them in ~/.config regardless. Save is clicked with the pointer."""
    from tests.app import xdo
    if not xdo.available():
        import pytest
        pytest.skip("real input needs xdotool (bash scripts/ensure_xvfb.sh)")
    home, config = tmp_path / "home", tmp_path / "xdg-config"
    monkeypatch.setenv("HOME", str(home))             # nothing may land in the real ~/.config
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    offered = []
    app = make_app(settings_path=None, builtin_presets_dir=tmp_path / "none",
                   ask_save_path=lambda folder: offered.append(folder) or str(folder / "a.json"))
    assert app.settings_path == config / "tempera" / "ui.json"
    app.geometry("1200x800+0+0")
    xdo.settle(app, 0.5)
    xdo.click(app, app.presets_bar.buttons["Save"])
    assert offered == [config / "tempera" / "presets"]
    assert (config / "tempera" / "presets" / "a.json").is_file()
    assert app.presets_bar.menu.get() == "mine / a"
    app.on_close()
    assert json.loads((config / "tempera" / "ui.json").read_text())["last_preset"].endswith(
        "a.json")
    assert not (home / ".config").exists()
