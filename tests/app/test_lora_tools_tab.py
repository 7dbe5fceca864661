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


@pytest.fixture
def kohya_lora(tempera_cache, tmp_path):
    """A random LoRA on the tiny SD 1.5 UNet's attention, in the kohya layout."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    from modules.models.kohya import save_kohya_lora
    base = ensure_builtin_model(MODEL_TYPES[ModelType.SD15].builtin, tempera_cache)
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet")
    unet.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"]))
    generator = torch.Generator().manual_seed(0)
    for key, param in unet.named_parameters():
        if "lora_" in key:
            param.data = torch.randn(param.shape, generator=generator) * 0.1
    return base, save_kohya_lora({"unet": unet}, tmp_path / "lora.safetensors", 8.0,
                                 ModelType.SD15)


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
    assert not panel.ok and "--model-type" in report and not other.exists()
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
