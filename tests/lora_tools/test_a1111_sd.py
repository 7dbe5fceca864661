"""AUTOMATIC1111's own LoRA loading code (extensions-builtin/Lora, run by
tests/models/a1111_harness.py; skipped without `pytest --a1111=PATH`) on the kohya / LyCORIS
files Tempera writes, at full size on the meta device (tests/models/a1111_sd.py says why):
the trainer's LoCon for SD 1.5, SD 2.x and SDXL, its LoHa and LoKr (SD 1.5, SDXL), its DoRA
(SD 1.5), and what `tempera-lora convert` writes from them.

For each file: A1111's `load_network` matches every key (its `keys_failed_to_match` is empty)
to the webui model's layer the adapter was trained on (the ldm / sgm / open_clip path found
from the diffusers name by diffusers' own ldm conversion and open_clip's naming, not by
A1111's or Tempera's), with the network module type of the adapter; `calc_updown` for a
sample of layers of each kind equals the update computed here from the file's tensors;
`NetworkOnDisk` reads the file's SD version from its metadata.

With --a1111 each case builds its full-size models on the meta device and writes its file
(about 10 s for SD 1.5, 30 s for SDXL, mostly peft injecting hundreds of layers); without it
nothing here runs (the session-scoped `a1111` skips first).
"""
from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from modules.cli.lora import main
from modules.config.schema import Adapter
from modules.model_types import ModelType
from modules.models.kohya import kohya_module_name
from tests.models.a1111_sd import FAMILY, expected_update, tempera_lora_file, webui_model

CASES = [(ModelType.SD15, Adapter.LOCON), (ModelType.SD2, Adapter.LOCON),
         (ModelType.SDXL, Adapter.LOCON), (ModelType.SD15, Adapter.LOHA),
         (ModelType.SD15, Adapter.LOKR), (ModelType.SDXL, Adapter.LOKR)]
MODULE_CLASS = {Adapter.LOCON: "NetworkModuleLora", Adapter.DORA: "NetworkModuleLora",
                Adapter.LOHA: "NetworkModuleHada", Adapter.LOKR: "NetworkModuleLokr"}
SD_VERSION = {ModelType.SD15: "SD1", ModelType.SD2: "SD2", ModelType.SDXL: "SDXL"}
# where each text encoder sits in the webui model, by Tempera's component name
ENCODER_ROOT = {ModelType.SD15: {"text_encoder": "cond_stage_model.wrapped"},
                ModelType.SD2: {"text_encoder": "cond_stage_model.wrapped"},
                ModelType.SDXL: {"text_encoder": "conditioner.embedders.0.wrapped",
                                 "text_encoder_2": "conditioner.embedders.1.wrapped"}}
OPEN_CLIP_ENCODERS = {(ModelType.SD2, "text_encoder"), (ModelType.SDXL, "text_encoder_2")}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load_in_a1111(a1111: Any, sd_model: Any, path: Path) -> tuple[Any, list[str]]:
    """(A1111's Network for the file, the messages A1111 logged about unmatched keys)."""
    a1111.shared.sd_model = sd_model
    records, root = _Records(), logging.getLogger()
    level, root.level = root.level, logging.DEBUG
    root.addHandler(records)
    try:
        on_disk = a1111.network.NetworkOnDisk(path.stem, str(path))
        net = a1111.networks.load_network(path.stem, on_disk)
    finally:
        root.removeHandler(records)
        root.setLevel(level)
    return net, [m for m in records.messages if "didn't match keys" in m]


@pytest.fixture(scope="module")
def webui(a1111):
    """{model type: the webui model A1111 walks}, each built on first use."""
    built: dict[ModelType, Any] = {}

    def get(model_type: ModelType) -> Any:
        if model_type not in built:
            built[model_type] = webui_model(a1111, model_type)
        return built[model_type]
    return get


@pytest.fixture(scope="module")
def written(a1111, webui, tmp_path_factory):
    """{(model type, adapter): Tempera's file, its components and A1111's load of it}."""
    done: dict[tuple[ModelType, Adapter], dict[str, Any]] = {}

    def get(model_type: ModelType, adapter: Adapter) -> dict[str, Any]:
        if (model_type, adapter) not in done:
            folder = tmp_path_factory.mktemp(f"a1111-{model_type.value}-{adapter.value}")
            path, components = tempera_lora_file(model_type, adapter,
                                                  folder / "lora.safetensors")
            net, unmatched = load_in_a1111(a1111, webui(model_type), path)
            done[model_type, adapter] = {"path": path, "components": components, "net": net,
                                         "unmatched": unmatched,
                                         "on_disk": net.network_on_disk}
        return done[model_type, adapter]
    return get


def _ldm_unet_names(webui_unet: torch.nn.Module, unet_config: Any) -> dict[str, str]:
    """{diffusers UNet parameter: ldm/sgm parameter}, by diffusers' own ldm checkpoint
    conversion run on the webui UNet's parameter names (each tensor a marker of its name)."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
    names = list(webui_unet.state_dict())
    markers = {f"model.diffusion_model.{n}": torch.tensor(float(i)) for i, n in enumerate(names)}
    converted = convert_ldm_unet_checkpoint(markers, dict(unet_config))
    return {key: names[int(value.item())] for key, value in converted.items()}


def _open_clip_path(path: str) -> str:
    """open_clip's name of a transformers CLIP text layer (q/k/v live in the attention's
    fused in_proj, so they name the attention module)."""
    m = re.fullmatch(r"(?:text_model\.)?encoder\.layers\.(\d+)\.(.+)", path)
    assert m, path
    block, rest = f"model.transformer.resblocks.{m[1]}", m[2]
    renames = {"self_attn.q_proj": "attn", "self_attn.k_proj": "attn", "self_attn.v_proj": "attn",
               "self_attn.out_proj": "attn.out_proj", "mlp.fc1": "mlp.c_fc",
               "mlp.fc2": "mlp.c_proj"}
    return f"{block}.{renames[rest]}"


def trained_layers(model_type: ModelType, case: dict[str, Any], sd_model: Any
                   ) -> dict[str, str]:
    """{kohya layer name in the file: the webui path of the layer it was trained on}."""
    from modules.models.kohya import adapter_layers
    unet = case["components"]["unet"]
    ldm = _ldm_unet_names(sd_model.model.diffusion_model, unet.config)
    out = {}
    for component, module in case["components"].items():
        for path in adapter_layers(module):
            name = kohya_module_name(component, path, model_type, unet.config)
            if component == "unet":
                out[name] = "model.diffusion_model." + ldm[path + ".weight"].removesuffix(".weight")
            elif (model_type, component) in OPEN_CLIP_ENCODERS:
                out[name] = f"{ENCODER_ROOT[model_type][component]}.{_open_clip_path(path)}"
            else:  # transformers' CLIP as A1111's transformers 4.30 names it
                text_path = path if path.startswith("text_model.") else "text_model." + path
                out[name] = f"{ENCODER_ROOT[model_type][component]}.transformer.{text_path}"
    return out


def webui_paths(sd_model: Any) -> dict[int, str]:
    """{id(module): its path in the webui model} for every module A1111 can match."""
    roots = {"model": sd_model.model}
    if sd_model.is_sdxl:
        for i, embedder in enumerate(sd_model.conditioner.embedders):
            roots[f"conditioner.embedders.{i}.wrapped"] = embedder.wrapped
    else:
        roots["cond_stage_model.wrapped"] = sd_model.cond_stage_model.wrapped
    return {id(m): f"{root}.{n}" if n else root
            for root, tree in roots.items() for n, m in tree.named_modules()}


def file_layers(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{layer name: {suffix: tensor}} of a kohya / LyCORIS file."""
    layers: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for key, tensor in load_file(str(path)).items():
        name, _, suffix = key.partition(".")
        layers[name][suffix] = tensor
    return dict(layers)


def assert_every_layer_on_its_trained_layer(a1111, net, unmatched, path, expected_targets,
                                            sd_model, module_class: str) -> None:
    assert not unmatched, unmatched[0][:2000]
    by_layer = {m.network_key.partition(".")[0]: m for m in net.modules.values()}
    layers = file_layers(path)
    assert set(by_layer) == set(layers), "layers A1111 folded together or left out: " + \
        ", ".join(sorted(set(layers) ^ set(by_layer))[:5])
    paths = webui_paths(sd_model)
    wrong = {name: paths.get(id(by_layer[name].sd_module)) for name in layers
             if paths.get(id(by_layer[name].sd_module)) != expected_targets[name]}
    assert not wrong, "A1111 put layers on other modules: " + ", ".join(
        f"{n} -> {p} (trained on {expected_targets[n]})" for n, p in list(wrong.items())[:5])
    kinds = {type(m).__name__ for m in net.modules.values()}
    assert kinds == {module_class}


def target_shape(module: Any) -> torch.Size:
    """The weight A1111 hands `calc_updown`: the layer's, or one third of a fused attention's
    in_proj (q, k or v; networks.network_apply_weights)."""
    sd_module = module.sd_module
    if isinstance(sd_module, torch.nn.MultiheadAttention) and not module.sd_key.endswith("out_proj"):
        return sd_module.in_proj_weight.chunk(3, 0)[0].shape
    if isinstance(sd_module, torch.nn.MultiheadAttention):
        return sd_module.out_proj.weight.shape
    return sd_module.weight.shape


def sample(net) -> list[Any]:
    """One module of each kind: the A1111 name with its block and layer numbers left out,
    and the layer class (every kind, not every layer: the full-size updates take seconds)."""
    kinds: dict[tuple[str, str], Any] = {}
    for key, module in net.modules.items():
        kinds.setdefault((re.sub(r"\d+", "N", key), type(module.sd_module).__name__), module)
    return list(kinds.values())


def assert_updates_equal_the_file_maths(net, path) -> None:
    layers = file_layers(path)
    checked = 0
    for module in sample(net):
        shape = target_shape(module)
        update, ex_bias = module.calc_updown(torch.zeros(shape))
        name = module.network_key.partition(".")[0]
        want = expected_update(layers[name], shape)
        assert ex_bias is None
        assert update.shape == shape, name
        # a max-norm bound (torch.testing.assert_close takes seconds on the 30M-entry convs)
        error = float((update.double() - want).abs().max())
        assert error <= 1e-5 * float(want.abs().max()) + 1e-9, f"{name}: off by {error}"
        checked += 1
    assert checked >= 10


def assert_file_holds_the_trained_loras(model_type: ModelType, case: dict[str, Any]) -> None:
    """Each LoRA layer's tensors in the file are its trained layer's (down = peft's lora_A,
    up = lora_B, alpha / rank = peft's scaling), so the name A1111 resolves carries them."""
    from modules.models.kohya import adapter_layers
    layers = file_layers(case["path"])
    unet_config = case["components"]["unet"].config
    for component, module in case["components"].items():
        for path, layer in adapter_layers(module).items():
            tensors = layers[kohya_module_name(component, path, model_type, unet_config)]
            assert torch.equal(tensors["lora_down.weight"], layer.lora_A["default"].weight), path
            assert torch.equal(tensors["lora_up.weight"], layer.lora_B["default"].weight), path
            rank = tensors["lora_down.weight"].shape[0]
            assert float(tensors["alpha"]) / rank == pytest.approx(layer.scaling["default"])


@pytest.mark.parametrize("model_type,adapter", CASES, ids=lambda v: v.value)
def test_a1111_puts_every_layer_on_the_layer_it_was_trained_on(a1111, webui, written,
                                                                model_type, adapter):
    case = written(model_type, adapter)
    sd_model = webui(model_type)
    assert_every_layer_on_its_trained_layer(
        a1111, case["net"], case["unmatched"], case["path"],
        trained_layers(model_type, case, sd_model), sd_model, MODULE_CLASS[adapter])
    assert case["on_disk"].sd_version.name == SD_VERSION[model_type]
    if adapter == Adapter.LOCON:
        assert_file_holds_the_trained_loras(model_type, case)


@pytest.mark.parametrize("model_type,adapter", CASES, ids=lambda v: v.value)
def test_a1111_update_equals_the_file_maths(a1111, written, model_type, adapter):
    case = written(model_type, adapter)
    assert_updates_equal_the_file_maths(case["net"], case["path"])


def peft_dora_update(tensors: dict[str, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """What a DoRA layer trained with peft changes `weight` by: its magnitude times the
    direction (weight + LoRA update) normalised per output channel, minus `weight`."""
    merged = weight.double() + expected_update(tensors, weight.shape)
    norm = merged.reshape(merged.shape[0], -1).norm(dim=1)
    magnitude = tensors["dora_scale"].double().reshape(-1)
    scale = (magnitude / norm).reshape(-1, *[1] * (weight.dim() - 1))
    return merged * scale - weight.double()


def test_a1111_reads_dora_files_onto_the_trained_layers(a1111, webui, written):
    """Tempera's DoRA (SD 1.5) loads as LoRA modules carrying the file's dora_scale, on the
    layers it was trained on."""
    case = written(ModelType.SD15, Adapter.DORA)
    sd_model = webui(ModelType.SD15)
    assert_every_layer_on_its_trained_layer(
        a1111, case["net"], case["unmatched"], case["path"],
        trained_layers(ModelType.SD15, case, sd_model), sd_model, "NetworkModuleLora")
    layers = file_layers(case["path"])
    for module in case["net"].modules.values():
        assert torch.equal(module.dora_scale, layers[module.network_key.partition(".")[0]]
                           ["dora_scale"])


@pytest.mark.xfail(strict=True, reason=(
    "A1111 v1.10 (network.py apply_weight_decompose) normalises the DoRA weight per input "
    "channel, LyCORIS's old wd_on_out=False form; peft's DoRA, which Tempera trains and "
    "writes (dora_scale of shape (out, 1)), normalises per output channel. A1111 reads the "
    "file without an error but applies another weight (docs/lora_tools.md)."))
def test_a1111_applies_a_dora_file_as_trained(a1111, written):
    case = written(ModelType.SD15, Adapter.DORA)
    layers = file_layers(case["path"])
    generator = torch.Generator().manual_seed(1)
    for module in sample(case["net"]):
        weight = torch.randn(target_shape(module), generator=generator) * 0.05
        update, _ = module.calc_updown(weight)
        want = peft_dora_update(layers[module.network_key.partition(".")[0]], weight)
        error = float((update.double() - want).abs().max())
        assert error <= 1e-5 * float(want.abs().max()), f"{module.network_key}: off by {error}"


@pytest.mark.parametrize("model_type", [ModelType.SD15, ModelType.SDXL], ids=lambda v: v.value)
def test_a1111_loads_what_tempera_lora_convert_writes(a1111, webui, written, tmp_path,
                                                      model_type):
    """A `tempera-lora convert` round trip (kohya -> diffusers -> kohya) of the trainer's
    LoCon: A1111 puts each layer on the trained one and applies the trained update exactly.
    (`resize` writes through the same writer; it is not run here: at full size it takes
    minutes on 2 cores.)"""
    case = written(model_type, Adapter.LOCON)
    sd_model = webui(model_type)
    peft, back = tmp_path / "peft.safetensors", tmp_path / "back.safetensors"
    common = ["--model-type", FAMILY[model_type]]
    assert main(["convert", "--lora", str(case["path"]), "--layout", "diffusers", *common,
                 "-o", str(peft)]) == 0
    assert main(["convert", "--lora", str(peft), "--layout", "kohya", *common,
                 "-o", str(back)]) == 0
    net, unmatched = load_in_a1111(a1111, sd_model, back)
    assert_every_layer_on_its_trained_layer(a1111, net, unmatched, back,
                                            trained_layers(model_type, case, sd_model),
                                            sd_model, "NetworkModuleLora")
    trained = file_layers(case["path"])
    for module in sample(net):
        shape = target_shape(module)
        update, _ = module.calc_updown(torch.zeros(shape))
        want = expected_update(trained[module.network_key.partition(".")[0]], shape)
        error = float((update.double() - want).abs().max())
        assert error <= 1e-5 * float(want.abs().max()) + 1e-9, f"{module.network_key}: {error}"
