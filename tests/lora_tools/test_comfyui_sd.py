"""ComfyUI's own checkpoint and LoRA loading (tests/models/comfyui_sd.py; skipped without
`pytest --comfyui=PATH`) of what `tempera-lora` writes for SD 1.5 and SDXL: each LoRA file the
tools write (merged several, extracted, resized, converted to kohya), applied by ComfyUI's
LoraLoader path to the tiny model's weights as ComfyUI loaded them, changes each weight by the
update computed here from the tools' inputs (up @ down · alpha / rank, torch's SVD) and no
other weight; a base merged into a single file loads in ComfyUI as the base with the LoRA
applied by ComfyUI.

With --comfyui the module's fixtures train the SD 1.5 LoCon once (about 15 s, the fixture of
test_lora_tools.py) and build the SDXL LoRA; without it nothing here runs (the session-scoped
`comfyui` skips first)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modules.cli.lora import main
from modules.config.schema import ModelType
from modules.models.families import family_files
from modules.models.single_file import save_single_file
from tests.lora_tools import test_lora_tools as tools_tests
from tests.lora_tools.test_lora_tools import _kohya_updates, _sd_kohya_name, _tuned_copy
from tests.models.comfyui_sd import (COMFY_CLASS, apply_lora, assert_applies, comfy_names,
                                     load_checkpoint)

# the tools tests' fixtures, shared here (module-scoped: built once more for this module)
trained, sdxl = tools_tests.trained, tools_tests.sdxl


@pytest.fixture(scope="module")
def sd15_single(comfyui, trained, tmp_path_factory):
    """The tiny SD 1.5 base as one ldm file and {kohya name: ComfyUI key} of its weights."""
    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained(trained["base"], safety_checker=None,
                                                   local_files_only=True)
    parts = {n: getattr(pipe, n) for n in ("unet", "vae", "text_encoder", "scheduler")}
    path = save_single_file(parts, tmp_path_factory.mktemp("sd15-single") / "base.safetensors",
                            family_files(ModelType.SD15))
    return {"path": path,
            "names": comfy_names(load_file(str(path)), ModelType.SD15, trained["base"])}


@pytest.mark.parametrize("model_type", [ModelType.SD15, ModelType.SDXL])
def test_comfyui_detects_the_tiny_unets_and_no_class_matches_their_size(
        comfyui, model_type, trained, sdxl, sd15_single):
    """Why the tests load through the matched class's own steps, not load_checkpoint_guess_config:
    ComfyUI's detection reads the tiny UNet as it is; its match against the supported models
    fails on the fixed full-size fields named here, and only on them."""
    from diffusers import UNet2DConditionModel
    folder, path = ((trained["base"], sd15_single["path"]) if model_type == ModelType.SD15
                    else (sdxl["folder"], sdxl["single"]))
    state = load_file(str(path))
    detected = comfyui.model_detection.detect_unet_config(state, "model.diffusion_model.")
    config = UNet2DConditionModel.load_config(folder / "unet")
    assert detected["model_channels"] == config["block_out_channels"][0] == 32
    assert detected["context_dim"] == config["cross_attention_dim"]
    assert detected["channel_mult"] == [c // 32 for c in config["block_out_channels"]]
    assert comfyui.model_detection.model_config_from_unet(state, "model.diffusion_model.") is None
    full = getattr(comfyui.supported_models, COMFY_CLASS[model_type]).unet_config
    differs = {k for k, v in full.items() if detected.get(k) != v}
    assert differs == ({"model_channels", "context_dim"} if model_type == ModelType.SD15 else
                       {"model_channels", "context_dim", "transformer_depth", "adm_in_channels"})


def _sd15_outputs(kind: str, trained, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The file the tool `kind` writes from the trained LoCon and the update of each layer
    computed from the tool's inputs."""
    base, kohya = ["--base", str(trained["base"])], str(trained["kohya"])
    original = _kohya_updates(trained["kohya"])
    out = tmp_path / f"{kind}.safetensors"
    if kind == "merge-loras":
        assert main(["merge-loras", *base, "--lora", f"{kohya}:0.5", "--lora",
                     f"{trained['diffusers']}:0.25", "-o", str(out)]) == 0
        return out, {k: 0.75 * v for k, v in original.items()}
    if kind == "resize":
        assert main(["resize", *base, "--lora", kohya, "--rank", "2", "-o", str(out)]) == 0
        best = {}
        for name, update in original.items():  # Eckart–Young: the truncated SVD
            u, s, vh = torch.linalg.svd(update.double(), full_matrices=False)
            best[name] = (u[:, :2] * s[:2] @ vh[:2]).float()
        return out, best
    if kind == "convert":  # the trainer's peft file (the same run) into kohya's layout
        assert main(["convert", *base, "--lora", str(trained["diffusers"]), "--layout",
                     "kohya", "-o", str(out)]) == 0
        return out, original
    tuned = tmp_path / "tuned"
    changes = _tuned_copy(trained["base"], tuned, torch.Generator().manual_seed(0))
    assert main(["extract", *base, "--tuned", str(tuned), "--rank", "32", "--conv-rank", "32",
                 "-o", str(out)]) == 0
    return out, {_sd_kohya_name(file.split("/")[0], key): change.flatten(1)
                 for (file, key), change in changes.items()}


@pytest.mark.parametrize("kind", ["merge-loras", "extract", "resize", "convert"])
def test_comfyui_applies_each_sd15_lora_the_tools_write(comfyui, trained, sd15_single, kind,
                                                        tmp_path, caplog):
    path, updates = _sd15_outputs(kind, trained, tmp_path)
    loaded = load_checkpoint(comfyui, sd15_single["path"], ModelType.SD15, trained["base"],
                             caplog)
    patched = apply_lora(comfyui, loaded, path, 0.8, caplog)
    assert_applies(loaded.weights, patched, sd15_single["names"], updates, 0.8,
                   atol=1e-5 if kind == "extract" else 1e-6)


def test_comfyui_loads_the_sd15_merged_single_file_as_its_lora_applied_to_the_base(
        comfyui, trained, sd15_single, tmp_path, caplog):
    out = tmp_path / "merged.safetensors"
    assert main(["merge", "--base", str(trained["base"]), "--lora",
                 f"{trained['kohya']}:0.7", "-o", str(out)]) == 0
    merged = load_checkpoint(comfyui, out, ModelType.SD15, trained["base"], caplog)
    base = load_checkpoint(comfyui, sd15_single["path"], ModelType.SD15, trained["base"], caplog)
    applied = apply_lora(comfyui, base, trained["kohya"], 0.7, caplog)
    assert merged.weights.keys() == applied.keys()
    for key, weight in applied.items():
        torch.testing.assert_close(merged.weights[key], weight, rtol=1e-5, atol=1e-6, msg=key)
    assert_applies(base.weights, merged.weights, sd15_single["names"],
                   _kohya_updates(trained["kohya"]), 0.7)
    # the rows ComfyUI's full-vocabulary CLIP cannot take (comfyui_sd.py): as the base's
    [(key, rows)] = merged.token_embeddings.items()
    assert torch.equal(rows, base.token_embeddings[key])


@pytest.mark.parametrize("kind", ["merge-loras", "resize", "convert", "extract", "merge"])
def test_comfyui_applies_the_sdxl_tool_outputs(comfyui, sdxl, kind, tmp_path, caplog):
    """SDXL: kohya's ldm UNet names, two encoders (OpenCLIP's q/k/v split by ComfyUI's
    conversion of the single file); `merge` is the single file the tool merges at 0.6, read
    by ComfyUI as the base with the LoRA applied at 0.6."""
    base = ["--base", str(sdxl["single"]), "--config-folder", str(sdxl["folder"])]
    lora = str(sdxl["lora"])
    original = _kohya_updates(sdxl["lora"])
    out = tmp_path / f"{kind}.safetensors"
    loaded = load_checkpoint(comfyui, sdxl["single"], ModelType.SDXL, sdxl["folder"], caplog)
    names = comfy_names(load_file(str(sdxl["single"])), ModelType.SDXL, sdxl["folder"])
    if kind == "merge":
        assert main(["merge", *base, "--lora", f"{lora}:0.6", "-o", str(out)]) == 0
        merged = load_checkpoint(comfyui, out, ModelType.SDXL, sdxl["folder"], caplog)
        applied = apply_lora(comfyui, loaded, sdxl["lora"], 0.6, caplog)
        for key, weight in applied.items():
            torch.testing.assert_close(merged.weights[key], weight, rtol=1e-5, atol=1e-6,
                                       msg=key)
        assert_applies(loaded.weights, merged.weights, names, original, 0.6)
        return
    if kind == "merge-loras":
        assert main(["merge-loras", *base, "--lora", f"{lora}:0.5", "--lora", f"{lora}:-0.2",
                     "-o", str(out)]) == 0
        updates = {k: 0.3 * v for k, v in original.items()}
    elif kind == "resize":
        assert main(["resize", *base, "--lora", lora, "--rank", "4", "-o", str(out)]) == 0
        updates = original  # rank 4 of a rank-4 LoRA: the same updates
    elif kind == "convert":
        peft = tmp_path / "peft.safetensors"
        assert main(["convert", *base, "--lora", lora, "--layout", "diffusers", "-o",
                     str(peft)]) == 0
        assert main(["convert", *base, "--lora", str(peft), "--layout", "kohya", "-o",
                     str(out)]) == 0
        updates = original
    else:  # extract from the base and the tool's merge at 0.6, full rank
        merged = tmp_path / "merged.safetensors"
        assert main(["merge", *base, "--lora", f"{lora}:0.6", "-o", str(merged)]) == 0
        assert main(["extract", *base, "--tuned", str(merged), "--rank", "8", "--conv-rank",
                     "8", "-o", str(out)]) == 0
        updates = {k: 0.6 * v for k, v in original.items()}
    patched = apply_lora(comfyui, loaded, out, 1.0, caplog)
    assert_applies(loaded.weights, patched, names, updates, 1.0, atol=1e-5)
