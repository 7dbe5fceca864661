"""Advanced Options: backend choice, component toggles and details land in the saved JSON."""
from __future__ import annotations

import json

import pytest

from app.compile_panel import TAB
from modules.config import load_config
from modules.config.schema import CompileBackend, CompileConfig, CompileMode, CompileScope

# On a CUDA machine (faked: the description renders the plan for the machine it is given).
BACKEND_MAPPING = {
    "NONE": ["not called"],
    "DEFAULT": ["torch.compile(model)", "inductor"],
    "INDUCTOR": ['backend="inductor"', '"max_autotune": True', '"epilogue_fusion": True',
                 '"triton.cudagraphs": False'],
    "TRITON": ['backend="inductor"', '"triton.cudagraphs": True', '"shape_padding": True',
               'no torch backend named "triton"'],
    "AOT_EAGER": ['backend="aot_eager"'],
}


@pytest.fixture
def app(shared_app):
    """The file's one window, reset to a fresh one's state before each test (conftest)."""
    return shared_app


def saved_compile(app, path) -> dict:
    assert app.presets_bar.save_as(path) == path
    return json.loads(path.read_text()).get("compile", {})


@pytest.mark.parametrize("backend", [b.value for b in CompileBackend])
def test_each_backend_is_saved_and_described(app, tmp_path, backend):
    from modules.compile import Capabilities

    panel = app.compile_panel
    panel.use_machine(lambda config: Capabilities.everything("cuda"))
    panel._load_summaries()
    panel.backend.menu._dropdown_callback(backend)        # as if picked from the menu
    saved = saved_compile(app, tmp_path / "p.json")
    assert saved.get("backend", "NONE") == backend        # sparse: the default may be omitted
    assert load_config(tmp_path / "p.json").compile.backend == CompileBackend(backend)
    text = panel.description.cget("text")
    for fragment in BACKEND_MAPPING[backend]:
        assert fragment in text, (backend, text)
    enabled = panel.toggles["compile.denoiser"].toggle.cget("state") == "normal"
    assert enabled == (backend != "NONE")


def test_the_description_says_what_training_will_run_and_why(app):
    # The plan training applies, not the backend's row: with gradient checkpointing around
    # regional blocks a CUDA machine runs TRITON without CUDA graphs, and the line says why.
    from modules.compile import Capabilities

    panel = app.compile_panel
    panel.use_machine(lambda config: Capabilities.everything("cuda"))
    panel._load_summaries()
    panel.backend.menu._dropdown_callback("TRITON")
    assert '"triton.cudagraphs": True' in panel.description.cget("text")
    app.binding.set_value("compile.scope", CompileScope.REGIONAL)
    app.binding.set_value("training.gradient_checkpointing", True)
    text = panel.description.cget("text")
    assert '"triton.cudagraphs": False' in text and "pytorch#154306" in text
    app.binding.set_value("compile.denoiser", False)
    assert "no component is selected" in panel.description.cget("text")


def test_component_toggles_and_details_are_saved(app, tmp_path):
    panel = app.compile_panel
    panel.backend.menu._dropdown_callback("INDUCTOR")
    defaults = saved_compile(app, tmp_path / "a.json")
    assert defaults == {"backend": "INDUCTOR"}            # UNet on, TE/VAE off by default

    for path in ("compile.denoiser", "compile.text_encoder", "compile.vae"):
        panel.toggles[path].toggle.toggle()               # a click on each checkbox
    views = {v.path: v for v in panel.details}
    other_scope = next(s for s in CompileScope if s != CompileConfig().scope).value
    views["compile.scope"].menu._dropdown_callback(other_scope)
    views["compile.mode"].menu._dropdown_callback("MAX_AUTOTUNE")
    views["compile.dynamic"].menu._dropdown_callback("STATIC")
    views["compile.fullgraph"].toggle.toggle()
    views["compile.strict"].toggle.toggle()
    views["compile.ahead"].toggle.toggle()
    views["compile.cache_dir"].var.set(str(tmp_path / "cc"))
    saved = saved_compile(app, tmp_path / "b.json")
    assert saved == {"backend": "INDUCTOR", "denoiser": False, "text_encoder": True, "vae": True,
                     "scope": other_scope, "mode": "MAX_AUTOTUNE", "dynamic": "STATIC",
                     "fullgraph": True, "strict": True, "ahead": True,
                     "cache_dir": "cc"}  # relative to preset
    loaded = load_config(tmp_path / "b.json").compile
    assert (loaded.scope, loaded.mode) == (CompileScope(other_scope), CompileMode.MAX_AUTOTUNE)
    assert loaded.cache_dir == str(tmp_path / "cc")


def test_compile_panel_sits_in_advanced_options_in_design_order(app):
    assert app.registry.tab_of["compile.backend"] == TAB
    panel = app.compile_panel
    ys = [panel.backend.frame.winfo_y(), panel.toggles["compile.denoiser"].frame.master.winfo_y(),
          *[v.frame.winfo_y() for v in panel.details], panel.check_button.master.winfo_y()]
    assert ys == sorted(ys)


def test_check_compilation_shows_the_report_of_the_chosen_backend(app):
    calls = []

    def fake_explain(config):
        calls.append(config.compile.backend)
        return f"UNet: {config.compile.backend.value} -> {config.compile.backend.value}, graph_breaks 0"

    app.compile_check.explain = fake_explain
    app.compile_panel.backend.menu._dropdown_callback("AOT_EAGER")
    app.compile_panel.check_button.invoke()
    from tests.app.conftest import pump
    pump(app, lambda: "graph_breaks" in app.compile_panel.report_text())
    assert calls == [CompileBackend.AOT_EAGER]
    assert app.guard.violations == []


def test_the_resolutions_field_takes_a_list_and_the_description_says_its_compile_cost(app):
    from modules.compile import Capabilities

    panel = app.compile_panel
    panel.use_machine(lambda config: Capabilities.everything("cuda"))
    panel._load_summaries()
    panel.backend.menu._dropdown_callback("AOT_EAGER")
    assert "shape set" not in panel.description.cget("text")  # one resolution, no buckets
    field = app.registry.find("data.resolutions")
    field.var.set("512, 1024")                             # typed into the form's entry
    assert app.binding.config.data.resolutions == [512, 1024]
    text = panel.description.cget("text")
    assert "compile: at most 2 shape set(s) (512 px: 1, 1024 px: 1)" in text
    assert "FULL builds at most 1 denoiser graph(s)" in text
    field.var.set("512, big")
    assert app.binding.config.data.resolutions == [512, 1024]  # refused, the last good value


def test_the_panel_says_whether_a_compile_bundle_is_ready_and_exports_and_imports_one(
        app, tmp_path):
    """The line under the compile details follows the bundles folder: none yet, then the one
    made for these settings (exportable); an imported bundle for other settings is copied and
    said to differ (with what differs); a file that is no bundle is refused and copies nothing."""
    import dataclasses

    import torch

    from modules.compile import detect_capabilities
    from modules.train.recipe.compile_guard import (bundle_folder, compile_facts,
                                                    compile_fingerprint)
    from tests.compile.bundle_files import fake_bundle

    panel = app.compile_panel
    panel.use_machine(lambda config: detect_capabilities("cpu"))
    app.binding.set_value("general.cache_dir", str(tmp_path / "cache"))
    panel.backend.menu._dropdown_callback("INDUCTOR")
    panel._load_summaries()
    assert "No compile bundle for these settings yet" in panel.bundle_line.cget("text")
    assert panel.export_button.cget("state") == "disabled"

    config = app.binding.config
    folder = bundle_folder(config)
    mine = compile_fingerprint(config, compile_facts(config, detect_capabilities("cpu")),
                               torch.device("cpu"))
    made = fake_bundle(folder, mine)
    app.binding.set_value("compile.strict", True)  # any compile setting: the line is redone
    app.binding.set_value("compile.strict", False)
    assert made.name in panel.bundle_line.cget("text") and "starts warm" in \
        panel.bundle_line.cget("text")
    assert panel.export_button.cget("state") == "normal"

    panel.ask_export = lambda name: str(tmp_path / "exported.tcb")
    panel.export_bundle()
    assert (tmp_path / "exported.tcb").read_bytes() == made.read_bytes()
    assert "Exported to" in panel.bundle_line.cget("text")

    made.unlink()
    other = fake_bundle(tmp_path / "elsewhere", dataclasses.replace(mine, family="SDXL"))
    panel.ask_import = lambda: str(other)
    panel.import_bundle()
    assert (folder / other.name).is_file()
    text = panel.bundle_line.cget("text")
    assert "made for other settings" in text and "family: this run SD15, bundle SDXL" in text

    junk = tmp_path / "junk.tcb"
    junk.write_text("not a bundle")
    panel.ask_import = lambda: str(junk)
    panel.import_bundle()
    assert "Not imported" in panel.bundle_line.cget("text")
    assert sorted(p.name for p in folder.iterdir()) == [other.name]
