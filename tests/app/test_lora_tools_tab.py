"""The LoRA tools tab: a tool run from the form through the engine (frontend.lora_tool), its
report shown; bad input shown with the field or file named, and nothing overwritten."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from modules.config.schema import ModelType
from modules.model_types import MODEL_TYPES
from modules.models.tiny import ensure_builtin_model
from tests.app.conftest import pump
from tests.lora_tools.random_lora import random_unet_lora


_FRESH: dict[int, dict] = {}  # the tab's fields as the shared window opened with them


@pytest.fixture
def app(shared_app):
    """The file's one window (conftest's `shared_app`), its LoRA tools tab as a fresh one's."""
    from app.text_boxes import set_readonly_text
    panel = shared_app.lora_tools
    fresh = _FRESH.setdefault(id(shared_app), {
        "entries": {name: entry.get() for name, entry in panel.entries.items()},
        "menus": {menu: menu.get() for menu in (panel.tool, panel.layout, panel.model_type)},
        "report": panel.report.get("1.0", "end-1c"), "tool_fn": panel.tool_fn})
    assert not panel.busy, "a test left a tool running"
    for name, entry in panel.entries.items():
        entry.delete(0, "end")
        if fresh["entries"][name]:
            entry.insert(0, fresh["entries"][name])
    panel.loras.delete("1.0", "end")
    for menu, value in fresh["menus"].items():
        menu.set(value)
    panel.tool_fn, panel.ok = fresh["tool_fn"], None
    set_readonly_text(panel.report, fresh["report"])
    panel._show_fields()
    shared_app.update()
    return shared_app


@pytest.fixture
def kohya_lora(tempera_cache, tmp_path):
    """A random LoRA on the tiny SD 1.5 UNet's attention, in the kohya layout."""
    base = ensure_builtin_model(MODEL_TYPES[ModelType.SD15].builtin, tempera_cache)
    return base, random_unet_lora(base, tmp_path / "lora.safetensors")


def _run(app, panel) -> str:
    panel.run_button.invoke()
    pump(app, lambda: not panel.busy, timeout=120)
    return panel.report.get("1.0", "end").strip()


def test_the_tab_converts_a_lora_and_refuses_bad_input(app, kohya_lora, tmp_path):
    base, lora = kohya_lora
    panel = app.lora_tools
    app.tabview.set("LoRA tools")
    panel.tool.set("Convert a LoRA's layout")
    panel._show_fields()
    app.update()
    assert not panel.entries["tuned"].winfo_ismapped() and panel.loras.winfo_ismapped()
    out = tmp_path / "peft.safetensors"
    panel.entries["base"].insert(0, str(base))
    panel.loras.insert("1.0", str(lora))
    panel.layout.set("diffusers")
    panel.entries["output"].insert(0, str(out))
    report = _run(app, panel)
    assert panel.ok and f"written: {out}" in report
    kohya, converted = load_file(str(lora)), load_file(str(out))
    names = {k.split(".")[0] for k in kohya}
    assert len(converted) == 2 * len(names) > 0
    for key in converted:  # each layer's update, computed here from both files' own tensors
        if ".lora_A." not in key:
            continue
        down, up = converted[key], converted[key.replace(".lora_A.", ".lora_B.")]
        path = key.removeprefix("unet.").split(".lora_A.")[0]
        name = "lora_unet_" + path.replace(".", "_")
        expected = (float(kohya[f"{name}.alpha"]) / 4 * kohya[f"{name}.lora_up.weight"]
                    @ kohya[f"{name}.lora_down.weight"])
        torch.testing.assert_close(up @ down, expected, rtol=1e-5, atol=1e-7)
    written = out.read_bytes()
    report = _run(app, panel)
    assert not panel.ok and "already exists" in report and str(out) in report
    assert out.read_bytes() == written
    # without a base or a model type the layers cannot be named: said, nothing written
    panel.entries["base"].delete(0, "end")
    other = tmp_path / "other.safetensors"
    panel.entries["output"].delete(0, "end")
    panel.entries["output"].insert(0, str(other))
    assert panel.model_type.get() == "from the base model"
    report = _run(app, panel)
    # named by the fields' labels, not the command line's flags
    assert not panel.ok and not other.exists()
    assert report == "Not done: Base model or Model type is needed to know the layers' names"
    # a rank that is not a number is named, and nothing runs
    panel.tool.set("Resize a LoRA")
    panel._show_fields()
    panel.entries["rank"].delete(0, "end")
    panel.entries["rank"].insert(0, "eight")
    panel.entries["output"].insert(0, str(tmp_path / "small.safetensors"))
    panel.run_button.invoke()
    assert not panel.busy
    assert "Rank: 'eight' is not a whole number" in panel.report.get("1.0", "end")
    assert not (tmp_path / "small.safetensors").exists()
    # the tab bar still fits the window's minimum width with the new tab
    assert app.tabview._segmented_button.winfo_reqwidth() <= 960


def test_browse_buttons_fill_the_fields_and_the_tab_runs_with_them(app, kohya_lora, tmp_path,
                                                                   monkeypatch):
    """Each path field's Browse buttons open the app's chooser (app/dialogs.py; Tk's, its
    functions patched here: a real one cannot be driven headless) at the field's folder,
    filtered to .safetensors; the chosen paths fill the form and the merge then runs on them."""
    from app import dialogs
    base, lora = kohya_lora
    monkeypatch.setenv("TEMPERA_FILE_DIALOG", "tk")
    asked: list[tuple[str, dict]] = []
    answers = {"askdirectory": str(base), "askopenfilename": str(lora),
               "asksaveasfilename": str(tmp_path / "merged")}
    for name, answer in answers.items():
        monkeypatch.setattr(dialogs.filedialog, name,
                            lambda n=name, a=answer, **kw: asked.append((n, kw)) or a)
    panel = app.lora_tools
    app.tabview.set("LoRA tools")
    panel.tool.set("Merge LoRAs into a model")
    panel._show_fields()
    app.update()
    assert panel.browse[("base", "folder")].winfo_ismapped()
    assert not panel.browse[("tuned", "file")].winfo_ismapped()  # extract's field is hidden
    panel.entries["base"].insert(0, str(tmp_path / "nowhere" / "model.safetensors"))
    panel.browse[("base", "folder")].invoke()
    assert panel.entries["base"].get() == str(base)
    assert asked[-1][1]["initialdir"] == str(tmp_path) + "/"  # the field's nearest folder
    panel.browse[("base", "file")].invoke()
    assert panel.entries["base"].get() == str(lora)  # a base may be a single file too
    assert asked[-1][0] == "askopenfilename"
    assert "*.safetensors" in asked[-1][1]["filetypes"][0][1]
    panel.browse[("base", "folder")].invoke()
    panel.browse[("loras", "file")].invoke()
    assert panel.loras.get("1.0", "end").strip() == str(lora)
    panel.browse[("output", "save")].invoke()
    assert asked[-1][0] == "asksaveasfilename" and asked[-1][1]["defaultextension"] == ""
    assert panel.entries["output"].get() == str(tmp_path / "merged")  # a merge: a folder
    assert panel.options() == {"command": "merge", "output": str(tmp_path / "merged"),
                               "base": str(base), "config_folder": None, "loras": [str(lora)],
                               "cache_dir": app.binding.config.general.cache_dir}
    report = _run(app, panel)
    assert panel.ok and f"written: {tmp_path / 'merged'}" in report
    assert (tmp_path / "merged" / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    panel.tool.set("Resize a LoRA")
    panel._show_fields()
    panel.browse[("output", "save")].invoke()
    assert asked[-1][1]["defaultextension"] == ".safetensors"  # a LoRA tool writes a file
    assert panel.entries["output"].get() == str(tmp_path / "merged.safetensors")


def test_the_tab_speaks_its_own_words_takes_builtin_bases_and_shows_progress(
        app, kohya_lora, tempera_cache, tmp_path):
    """The demo's model as the base (`builtin:tiny-sd15`, built in the settings' Cache folder
    as training builds it); each tool's hints; a refusal naming the field by its label; the
    result first in the report; resize's progress shown while it runs."""
    import threading

    from modules import frontend
    _, lora = kohya_lora
    app.binding.set_value("general.cache_dir", str(tempera_cache))
    panel = app.lora_tools
    app.tabview.set("LoRA tools")
    hints = {}
    for label in ("Merge LoRAs into a model", "Convert a LoRA's layout", "Resize a LoRA"):
        panel.tool.set(label)
        panel._show_fields()
        hints[label] = (panel.entries["output"].cget("placeholder_text"),
                        panel.loras_label.cget("text"))
    assert "folder" in hints["Merge LoRAs into a model"][0]
    assert "base is not changed" in hints["Merge LoRAs into a model"][0]
    assert "file:weight" in hints["Merge LoRAs into a model"][1]
    for label in ("Convert a LoRA's layout", "Resize a LoRA"):  # one file in, one file out
        output_hint, loras_label = hints[label]
        assert "folder" not in output_hint and ".safetensors LoRA file" in output_hint
        assert loras_label == "LoRA file"
    panel.entries["base"].insert(0, "builtin:tiny-sd15")
    panel.loras.insert("1.0", str(lora))
    panel.entries["rank"].delete(0, "end")
    panel.entries["rank"].insert(0, "0")
    out = tmp_path / "small.safetensors"
    panel.entries["output"].insert(0, str(out))
    report = _run(app, panel)
    assert not panel.ok and report == "Not done: Rank 0: must be at least 1"
    panel.entries["rank"].delete(0, "end")
    panel.entries["rank"].insert(0, "2")
    calls: list[tuple[int, int, str]] = []
    go_on = threading.Event()

    def held_at_the_first_layer(**options):
        progress = options.pop("progress")

        def watched(done: int, total: int, what: str) -> None:
            calls.append((done, total, what))
            progress(done, total, what)
            if done == 1:
                go_on.wait(60)  # until the window has shown it
        return frontend.lora_tool(**options, progress=watched)
    panel.tool_fn = held_at_the_first_layer
    panel.run_button.invoke()
    pump(app, lambda: "layer 1 of" in panel.report.get("1.0", "end"), timeout=120)
    assert panel.busy and calls[0][2] in panel.report.get("1.0", "end")
    go_on.set()
    pump(app, lambda: not panel.busy, timeout=120)
    report = panel.report.get("1.0", "end").strip().splitlines()
    assert panel.ok and report[0] == f"written: {out}" and out.is_file()
    layers = len(load_file(str(lora))) // 3  # kohya: down, up and alpha of each layer
    assert [c[:2] for c in calls] == [(i, layers) for i in range(1, layers + 1)]
    assert len(report) == 2 + layers  # the result, what it is, then a line per layer
