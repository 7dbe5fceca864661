"""output.save_dtype: every saved format holds its weights in that dtype, loads back, and a
cast that cannot hold the weights is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modules.config.schema import ModelType
from modules.models.precision import SavePrecisionError, cast_for_saving
from modules.models.single_file import load_single_file
from modules.train.trainer import train


def file_dtypes(folder: Path) -> dict[str, set[torch.dtype]]:
    """{file relative to folder: the dtypes of its floating-point tensors}."""
    found = {}
    for path in sorted(folder.rglob("*.safetensors")):
        tensors = load_file(str(path))
        found[str(path.relative_to(folder))] = {
            v.dtype for k, v in tensors.items() if v.is_floating_point() and not k.endswith(".alpha")}
    return found


def test_a_float16_cast_that_overflows_is_refused_and_bfloat16_holds_it():
    tensors = {"layer.weight": torch.tensor([1.0, 7e4])}
    with pytest.raises(SavePrecisionError, match=r"unet: layer.weight holds 70000.*BFLOAT16"):
        cast_for_saving(tensors, torch.float16, "unet")
    assert cast_for_saving(tensors, torch.bfloat16, "unet")["layer.weight"].dtype == torch.bfloat16
    assert cast_for_saving(tensors, None, "unet")["layer.weight"].dtype == torch.float32


def test_float16_lora_in_both_layouts_loads_and_keeps_exact_alphas(tiny_config, pipelines):
    result = train(tiny_config("training.max_steps=2", "components.text_encoder.train=true",
                               "training.lora_alpha=0.3", "output.formats=diffusers,kohya",
                               "output.save_dtype=FLOAT16"))
    final = result.output_dir / "final"
    assert file_dtypes(final) == {"lora_kohya.safetensors": {torch.float16},
                                  "pytorch_lora_weights.safetensors": {torch.float16}}
    alphas = {v.dtype: float(v) for k, v in load_file(str(final / "lora_kohya.safetensors")).items()
              if k.endswith(".alpha")}
    assert alphas == {torch.float32: pytest.approx(0.3, abs=1e-7)}  # the strength stays exact
    base = Path(json.loads((result.output_dir / "config.json").read_text())["model"]["path"])
    pipe = pipelines.load(base)
    before = pipelines.image(pipe)
    for name in ("pytorch_lora_weights.safetensors", "lora_kohya.safetensors"):
        pipe.load_lora_weights(str(final), weight_name=name, adapter_name=name.split(".")[0])
        pipe.set_adapters(name.split(".")[0])
        assert not torch.allclose(pipelines.image(pipe), before, atol=1e-4), name
        pipe.unload_lora_weights()


def test_bfloat16_fine_tune_in_both_formats_holds_the_same_bfloat16_weights(tiny_config,
                                                                            pipelines):
    result = train(tiny_config("training.method=FINE_TUNE", "training.max_steps=1",
                               "output.formats=diffusers,single_file",
                               "output.save_dtype=BFLOAT16"))
    final = result.output_dir / "final"
    dtypes = file_dtypes(final)
    assert {"model.safetensors", "unet/diffusion_pytorch_model.safetensors",
            "vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"} <= set(dtypes)
    assert all(found == {torch.bfloat16} for found in dtypes.values()), dtypes
    assert json.loads((final / "text_encoder" / "config.json").read_text()).get(
        "dtype", "bfloat16") == "bfloat16"
    base = Path(json.loads((result.output_dir / "config.json").read_text())["model"]["path"])
    single = load_single_file(final / "model.safetensors", ModelType.SD15, config_folder=base)
    folder = pipelines.load(final)  # from_pretrained reads the bfloat16 folder
    for name in ("unet", "vae", "text_encoder"):
        want, got = getattr(folder, name).state_dict(), single[name].state_dict()
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key].float(), got[key].float()), f"{name}.{key}"
    conv = folder.unet.conv_in.weight.float()
    assert torch.equal(conv, conv.to(torch.bfloat16).float())  # bfloat16 values, loaded
