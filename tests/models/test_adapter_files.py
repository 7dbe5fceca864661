"""Every adapter's kohya / LyCORIS file, read back by a reference reader written here.

The reader knows only the published layout (LyCORIS's definitions, which ComfyUI's
weight_adapter and A1111 follow): it maps each name onto a module, rebuilds the weight update
from the tensors and alpha, and the test checks that the base weight with that update applied
gives what the trained peft layer gives, layer by layer, on random inputs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from modules.config.schema import ModelType
from modules.models.kohya import adapter_layers, kohya_module_name, save_kohya_lora
from modules.models.tiny import ensure_builtin_model
from modules.model_types import MODEL_TYPES
from modules.train.recipe.adapters import add_adapter

CASES = {
    "lora-rslora": ("training.adapter=LORA", "training.use_rslora=true"),
    "locon": ("training.adapter=LOCON", "training.conv_rank=2", "training.conv_alpha=1"),
    "locon-rslora": ("training.adapter=LOCON", "training.conv_rank=4", "training.use_rslora=true"),
    "loha": ("training.adapter=LOHA", "training.conv_rank=2", "training.conv_alpha=3"),
    "lokr-full": ("training.adapter=LOKR", "training.conv_rank=4"),
    "lokr-decomposed": ("training.adapter=LOKR", "training.lora_rank=2", "training.conv_rank=2",
                        "training.lokr_factor=4"),
    "dora": ("training.adapter=DORA", "training.conv_rank=2"),
}
RANK, ALPHA = 4, 8.0  # alpha != rank: a reader that ignores alpha gets another update


def _components(model_type: ModelType, cache) -> dict[str, torch.nn.Module]:
    import diffusers
    spec = MODEL_TYPES[model_type]
    folder = ensure_builtin_model(spec.builtin, cache)
    pipe = getattr(diffusers, spec.pipeline_class).from_pretrained(folder, local_files_only=True)
    return {"unet": pipe.unet, **{n: getattr(pipe, n) for n in spec.text_encoders}}


def _adapted(config, model_type, cache):
    """The components with the configured adapter, every adapter tensor random and nonzero."""
    modules = _components(model_type, cache)
    generator = torch.Generator().manual_seed(3)
    for name, module in modules.items():
        module.requires_grad_(False)
        add_adapter(module, config, denoiser=name == "unet")
        for key, param in module.named_parameters():
            if not param.requires_grad:
                continue
            noise = torch.randn(param.shape, generator=generator)
            # DoRA's magnitudes start at the weight norms: scale them, keep them positive
            param.data = (param.data * (1 + 0.2 * noise) if "magnitude" in key
                          else noise * 0.2)
        module.eval()
    return modules


# ------------------------------------------------------------------ the reference reader
def _update(t: dict[str, torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """The weight update one layer's tensors mean, per LyCORIS's definitions."""
    alpha = float(t["alpha"])
    if "lora_down.weight" in t:
        down, up = t["lora_down.weight"], t["lora_up.weight"]
        return (up.flatten(1) @ down.flatten(1)).reshape(shape) * alpha / down.shape[0]
    if "hada_w1_a" in t:
        rank = t["hada_w1_b"].shape[0]
        w1 = t["hada_w1_a"] @ t["hada_w1_b"]
        w2 = t["hada_w2_a"] @ t["hada_w2_b"]
        return (w1 * w2).reshape(shape) * alpha / rank
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    rank = (t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t else
            t["lokr_w1_b"].shape[0] if "lokr_w1_b" in t else None)
    scale = alpha / rank if rank else 1.0  # both factors full: no scale
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    return torch.kron(w1, w2).reshape(shape) * scale


def _merged(t: dict[str, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    merged = weight + _update(t, weight.shape)
    if "dora_scale" in t:  # output-axis weight decomposition
        scale = t["dora_scale"]
        assert scale.shape == (weight.shape[0], *[1] * (weight.dim() - 1))
        norm = merged.reshape(weight.shape[0], -1).norm(dim=1)
        merged = merged * (scale.flatten() / norm).reshape(scale.shape)
    return merged


def _apply(base: torch.nn.Module, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if isinstance(base, torch.nn.Conv2d):
        return F.conv2d(x, weight, base.bias, base.stride, base.padding, base.dilation,
                        base.groups)
    return F.linear(x, weight, base.bias)


def _input(base: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    if isinstance(base, torch.nn.Conv2d):
        return torch.randn((2, base.in_channels, 8, 8), generator=generator)
    return torch.randn((3, base.in_features), generator=generator)


def _groups(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, suffix = key.split(".", 1)
        groups.setdefault(name, {})[suffix] = value
    return groups


SUFFIXES = {
    "lora": {"lora_down.weight", "lora_up.weight", "alpha"},
    "dora": {"lora_down.weight", "lora_up.weight", "alpha", "dora_scale"},
    "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
}


def _check_layer_set(suffixes: set[str]) -> None:
    if any(s.startswith("lokr_") for s in suffixes):
        assert "alpha" in suffixes
        for factor in ("w1", "w2"):
            assert (f"lokr_{factor}" in suffixes) != ({f"lokr_{factor}_a",
                                                      f"lokr_{factor}_b"} <= suffixes)
        return
    assert suffixes in SUFFIXES.values(), suffixes


# ------------------------------------------------------------------------- the tests
# SD 2.x files use SD 1.x's names (one CLIP text encoder, the same UNet layout): a few cases
# on the tiny SD 2 model (OpenCLIP-shaped, v-prediction) check that nothing assumes SD 1.5.
SD_CASES = [(ModelType.SD15, case) for case in CASES] + [
    (ModelType.SD2, case) for case in ("locon", "loha", "lokr-decomposed", "dora")]


@pytest.mark.parametrize("model_type,case", SD_CASES)
def test_sd1_and_sd2_file_is_what_the_trained_layers_apply(model_type, case, tiny_config,
                                                           tempera_cache, tmp_path):
    config = tiny_config(f"model.type={model_type.value}",
                         f"model.path={MODEL_TYPES[model_type].builtin}",
                         f"training.lora_rank={RANK}", f"training.lora_alpha={ALPHA}",
                         *CASES[case])
    modules = _adapted(config, model_type, tempera_cache)
    path = save_kohya_lora(modules, tmp_path / "a.safetensors", None, model_type)
    groups = _groups(load_file(str(path)))
    prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te_"}
    seen = set()
    for component, module in modules.items():
        layers = adapter_layers(module)
        assert layers, component
        # SD 1.x names: the module path, "text_model." for CLIP, dots to underscores
        for module_path, layer in layers.items():
            path_name = module_path if component == "unet" else (
                module_path if module_path.startswith("text_model.") else
                "text_model." + module_path)
            name = prefixes[component] + path_name.replace(".", "_")
            assert name in groups, f"{case}: no tensors for {module_path}"
            seen.add(name)
            tensors = groups[name]
            _check_layer_set(set(tensors))
            assert tensors["alpha"].ndim == 0
            base = layer.get_base_layer()
            x = _input(base)
            with torch.no_grad():
                expected = layer(x)
                got = _apply(base, _merged(tensors, base.weight), x)
            assert not torch.allclose(expected, base(x), atol=1e-3), f"{module_path}: no update"
            assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), \
                f"{case}: {module_path} differs by {(got - expected).abs().max():.2e}"
    assert seen == set(groups), f"names that map onto no adapted module: {set(groups) - seen}"


def test_locon_family_adapts_convolutions_and_projections(tiny_config, tempera_cache):
    config = tiny_config("training.adapter=LOHA", "training.conv_rank=2")
    layers = adapter_layers(_adapted(config, ModelType.SD15, tempera_cache)["unet"])
    for kind in ("resnets.0.conv1", "resnets.0.conv2", "time_emb_proj", "proj_in", "ff.net.2",
                 "attn1.to_q", "downsamplers.0.conv"):
        assert any(path.endswith(kind) for path in layers), kind
    conv = next(layer for path, layer in layers.items() if path.endswith("conv1"))
    assert conv.r["default"] == 2 and conv.scaling["default"] == pytest.approx(1 / 2)
    plain = adapter_layers(_adapted(tiny_config(), ModelType.SD15, tempera_cache)["unet"])
    assert all(p.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v", "0") for p in plain)


@pytest.mark.parametrize("case", ["locon", "loha", "lokr-decomposed", "dora"])
def test_sdxl_names_are_the_ldm_names_of_every_adapted_layer(case, tiny_config, tempera_cache,
                                                            tmp_path):
    config = tiny_config("model.type=SDXL", "model.path=builtin:tiny-sdxl", *CASES[case])
    modules = _adapted(config, ModelType.SDXL, tempera_cache)
    path = save_kohya_lora(modules, tmp_path / "x.safetensors", None, ModelType.SDXL)
    groups = _groups(load_file(str(path)))
    names = {}
    for component, module in modules.items():
        for module_path, layer in adapter_layers(module).items():
            name = kohya_module_name(component, module_path, ModelType.SDXL,
                                     modules["unet"].config)
            assert name not in names
            names[name] = (module_path, layer)
    assert set(names) == set(groups)
    prefixes = {n.split("_")[1] for n in groups}
    assert prefixes == {"unet", "te1", "te2"}
    # ldm names for the UNet: resnets are in_layers / out_layers / emb_layers
    unet = [n for n in groups if n.startswith("lora_unet_")]
    assert any(n.startswith("lora_unet_input_blocks_") for n in unet)
    assert not any("down_blocks" in n or "resnets" in n for n in unet)
    assert any(n.endswith("_in_layers_2") for n in unet)
    if case != "dora":
        assert any(n.endswith("_emb_layers_1") for n in unet)
    for name, (module_path, layer) in names.items():
        base = layer.get_base_layer()
        x = _input(base)
        with torch.no_grad():
            assert torch.allclose(_apply(base, _merged(groups[name], base.weight), x),
                                  layer(x), atol=1e-4, rtol=1e-4), module_path
