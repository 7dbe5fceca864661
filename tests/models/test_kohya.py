"""kohya-layout LoRA files: names that map onto real modules, and diffusers reads them right."""
from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from modules.config.schema import ModelType
from modules.models.kohya import KohyaError, save_kohya_lora
from modules.models.tiny import ensure_builtin_model
from modules.model_types import MODEL_TYPES

RANK, ALPHA = 4, 8.0  # alpha != rank, so a reader that ignores alpha gets a different image
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in"]  # proj_in: a 1x1 conv in SD 1.x
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def _pipeline(model_type, cache):
    import diffusers
    folder = ensure_builtin_model(MODEL_TYPES[model_type].builtin, cache)
    cls = getattr(diffusers, MODEL_TYPES[model_type].pipeline_class)
    pipe = cls.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe):
    return pipe("a red circle", height=64, width=64, num_inference_steps=2,
                generator=torch.Generator().manual_seed(0), output_type="pt").images


def _adapt(pipe, model_type):
    """Random LoRA adapters on the UNet and every text encoder (B is nonzero, unlike at init)."""
    from peft import LoraConfig
    modules = {"unet": pipe.unet,
               **{n: getattr(pipe, n) for n in MODEL_TYPES[model_type].text_encoders}}
    generator = torch.Generator().manual_seed(1)
    for name, module in modules.items():
        targets = UNET_TARGETS if name == "unet" else TEXT_TARGETS
        module.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights="gaussian",
                                      target_modules=targets))
        for key, param in module.named_parameters():
            if "lora_B" in key:
                param.data = torch.randn(param.shape, generator=generator) * 0.05
    return modules


def _save_peft_layout(pipe, modules, folder):
    """The reference: diffusers' own LoRA layout, keys as peft gives them."""
    from peft.utils import get_peft_model_state_dict
    kwargs = {}
    for name, module in modules.items():
        kwargs[f"{name}_lora_layers"] = get_peft_model_state_dict(module)
        kwargs[f"{name}_lora_adapter_metadata"] = module.peft_config["default"].to_dict()
    type(pipe).save_lora_weights(folder, weight_name="peft.safetensors", **kwargs)


@pytest.fixture(scope="module", params=[ModelType.SD15, ModelType.SD2, ModelType.SDXL],
                ids=["sd15", "sd2", "sdxl"])
def saved(request, tempera_cache, tmp_path_factory):
    model_type = request.param
    folder = tmp_path_factory.mktemp(f"kohya-{model_type.value}")
    pipe = _pipeline(model_type, tempera_cache)
    base = _image(pipe)
    modules = _adapt(pipe, model_type)
    adapted = _image(pipe)
    _save_peft_layout(pipe, modules, folder)
    path = save_kohya_lora(modules, folder / "kohya.safetensors", ALPHA, model_type,
                           {"ss_network_dim": str(RANK)})
    return {"type": model_type, "modules": modules, "path": path, "folder": folder,
            "base": base, "adapted": adapted}


def _module_paths(module):
    """Every adapted layer's module path, in the `text_model.` form kohya names use."""
    from peft.tuners.lora import LoraLayer
    return [n for n, m in module.named_modules() if isinstance(m, LoraLayer)]


def test_every_kohya_name_maps_one_to_one_onto_an_adapted_module(saved):
    from diffusers.loaders.lora_conversion_utils import (
        _convert_unet_lora_key, _maybe_map_sgm_blocks_to_diffusers)

    tensors = load_file(saved["path"])
    names = {k.split(".")[0] for k in tensors}
    assert all(f"{n}.{part}" in tensors for n in names
               for part in ("lora_down.weight", "lora_up.weight", "alpha"))
    assert len(tensors) == 3 * len(names)
    prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te_", "text_encoder_2": "lora_te2_"}
    if saved["type"] == ModelType.SDXL:
        prefixes["text_encoder"] = "lora_te1_"
    for component, module in saved["modules"].items():
        prefix = prefixes[component]
        mine = {n for n in names if n.startswith(prefix)}
        paths = _module_paths(module)
        assert len(mine) == len(paths)
        if component == "unet" and saved["type"] == ModelType.SDXL:
            # ldm names: map them back with diffusers' own sgm converter.
            sgm = _maybe_map_sgm_blocks_to_diffusers(
                {f"{n}.lora_down.weight": None for n in mine}, module.config)
            found = {_diffusers_module(_convert_unet_lora_key(k)) for k in sgm}
        else:
            by_underscores = {p.replace(".", "_"): p for p in paths}
            by_underscores.update({("text_model." + p).replace(".", "_"): p for p in paths})
            found = {by_underscores[n.removeprefix(prefix)] for n in mine}
        assert found == set(paths)
        for path in found:
            down = tensors[f"{_name_of(names, prefix, path, saved)}.lora_down.weight"]
            assert down.shape[0] == RANK
            module.get_submodule(path)


def _diffusers_module(converted_key):
    """diffusers' legacy LoRA key (`attn1.processor.to_out_lora.down.weight`) -> module path."""
    path = re.sub(r"[._]lora\.down\.weight$", "", converted_key).replace(".processor", "")
    return path + ".0" if path.endswith("to_out") else path


def _name_of(names, prefix, path, saved):
    """The kohya name for a module path (SDXL's UNet: found via the shape-free ldm mapping)."""
    from modules.models.kohya import kohya_module_name
    component = {"lora_unet_": "unet", "lora_te_": "text_encoder", "lora_te1_": "text_encoder",
                 "lora_te2_": "text_encoder_2"}[prefix]
    name = kohya_module_name(component, path, saved["type"], saved["modules"]["unet"].config)
    assert name in names
    return name


def test_diffusers_loads_the_kohya_file_renders_what_the_peft_layout_renders_and_reads_alpha(
        saved, tempera_cache, tmp_path):
    """One test, so the pipeline that loaded the kohya file is the one whose alpha is read."""
    assert not torch.allclose(saved["base"], saved["adapted"], atol=1e-3)
    peft_pipe = _pipeline(saved["type"], tempera_cache)
    peft_pipe.load_lora_weights(saved["folder"], weight_name="peft.safetensors")
    kohya_pipe = _pipeline(saved["type"], tempera_cache)
    kohya_pipe.load_lora_weights(saved["folder"], weight_name=saved["path"].name)
    for component, module in saved["modules"].items():
        loaded = getattr(kohya_pipe, component)
        assert len(_module_paths(loaded)) == len(_module_paths(module)), component
    from_peft, from_kohya = _image(peft_pipe), _image(kohya_pipe)
    assert torch.allclose(from_peft, saved["adapted"], atol=1e-4)
    assert torch.allclose(from_kohya, from_peft, atol=1e-4)
    assert_alpha_is_honoured(saved, kohya_pipe, tempera_cache, tmp_path)


def assert_alpha_is_honoured(saved, pipe, tempera_cache, tmp_path):
    """The alpha is written as kohya writes it and read: `pipe` (the kohya file loaded)
    scales by alpha / rank, and the same file with alpha = rank renders differently."""
    tensors = load_file(saved["path"])
    assert all(float(v) == ALPHA for k, v in tensors.items() if k.endswith(".alpha"))
    assert all(v.ndim == 0 for k, v in tensors.items() if k.endswith(".alpha"))
    layer = next(m for m in pipe.unet.modules() if hasattr(m, "scaling") and m.scaling)
    assert next(iter(layer.scaling.values())) == pytest.approx(ALPHA / RANK)
    save_file({k: (torch.tensor(float(RANK)) if k.endswith(".alpha") else v)
               for k, v in tensors.items()}, str(tmp_path / "rank_alpha.safetensors"))
    other = _pipeline(saved["type"], tempera_cache)
    other.load_lora_weights(tmp_path, weight_name="rank_alpha.safetensors")
    assert not torch.allclose(_image(other), saved["adapted"], atol=1e-3)


def test_metadata_is_written(saved):
    assert safe_open(str(saved["path"]), "pt").metadata()["ss_network_dim"] == str(RANK)


def test_unsupported_adapters_and_wrong_alpha_are_refused(tempera_cache, tmp_path):
    from peft import LoraConfig
    pipe = _pipeline(ModelType.SD15, tempera_cache)
    pipe.unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"]))
    with pytest.raises(KohyaError, match="lora_alpha=2"):
        save_kohya_lora({"unet": pipe.unet}, tmp_path / "a.safetensors", 4.0, ModelType.SD15)
    from peft import LoHaConfig
    other = _pipeline(ModelType.SD15, tempera_cache)
    other.unet.add_adapter(LoHaConfig(r=2, alpha=2, target_modules=["conv1"],
                                      use_effective_conv2d=True))
    with pytest.raises(KohyaError, match="resnets.0.conv1: LoHa's Tucker form"):
        save_kohya_lora({"unet": other.unet}, tmp_path / "b.safetensors", None, ModelType.SD15)
    assert not list(tmp_path.iterdir())
