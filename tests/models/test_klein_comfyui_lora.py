"""Klein's LoRA in ComfyUI's layout (KOHYA output): kohya's `lora_unet_` + the BFL name of each
layer with "_", q / k / v of each stream written as one LoRA of the fused `qkv`. Checked
against the diffusers layout: the update each BFL tensor gets, applied to the BFL weights by
the key map ComfyUI builds for such names (`lora_unet_<key with _>` -> that key's weight),
read back by diffusers' own BFL reader (Flux2Transformer2DModel.from_single_file), is the
trained LoRA merged by peft; diffusers' Flux2 LoRA loader reads the file as the diffusers one.
LoHa and LoKr have no fused form: their file names each layer `lycoris_` + its diffusers path
with "_", the names ComfyUI gives diffusers' Flux layers (it applies q / k / v to their rows
of `qkv` itself), checked against that map as ComfyUI documents it. ComfyUI's own loading code
needs a ComfyUI checkout (`pytest --comfyui=PATH`), which this repository never holds (GPL-3):
those tests are skipped without one (run on the checkout docs/klein.md names)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from modules.config import Config, apply_overrides
from modules.model_types import MODEL_TYPES, ModelType
from modules.models.kohya import KohyaError, save_kohya_lora
from modules.train.recipe.loss_checks import family_problems

# the trainer's preset targets, and the text stream's v left out (a fused qkv LoRA then has
# zero rows there: that projection is unchanged); the single blocks' output too (BFL's
# `linear2`; named apart from the double blocks' ModuleList by the expression)
TARGETS = (r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|"
           r"to_add_out)|ff\.linear_in|ff_context\.linear_out)|single_transformer_blocks\.\d+\."
           r"attn\.(to_qkv_mlp_proj|to_out)")


@pytest.fixture(scope="module")
def klein_folder(tempera_cache):
    from modules.models.tiny import ensure_builtin_model
    return ensure_builtin_model(MODEL_TYPES[ModelType.KLEIN].builtin, tempera_cache)


def _lora_transformer(folder, adapter: str = "lora", seed: int = 1):
    from diffusers import Flux2Transformer2DModel
    from peft import LoKrConfig, LoraConfig
    transformer = Flux2Transformer2DModel.from_pretrained(folder, subfolder="transformer",
                                                          local_files_only=True)
    config = (LoKrConfig(r=4, alpha=8.0, target_modules=TARGETS) if adapter == "lokr"
              else LoraConfig(r=4, lora_alpha=8.0, target_modules=TARGETS,
                              use_dora=adapter == "dora"))
    transformer.add_adapter(config)
    generator = torch.Generator().manual_seed(seed)
    for key, param in transformer.named_parameters():
        if "lora_" in key or "lokr_" in key:  # DoRA's magnitude too (lora_magnitude_vector)
            param.data = torch.randn(param.shape, generator=generator) * 0.1
    return transformer


@pytest.fixture(scope="module")
def saved(klein_folder, tmp_path_factory):
    transformer = _lora_transformer(klein_folder)
    path = tmp_path_factory.mktemp("klein-comfy") / "klein_lora.safetensors"
    save_kohya_lora({"transformer": transformer}, path, None, ModelType.KLEIN)
    return transformer, path


def _updates(path) -> dict[str, torch.Tensor]:
    """{BFL name: alpha / rank · up @ down}, as ComfyUI computes a LoRA patch."""
    tensors = load_file(str(path))
    return {k.removesuffix(".lora_down.weight"):
            float(tensors[k.replace("lora_down.weight", "alpha")]) / tensors[k].shape[0]
            * (tensors[k.replace("lora_down", "lora_up")] @ tensors[k])
            for k in tensors if k.endswith(".lora_down.weight")}


def _comfyui_key_map(weights: dict | None = None) -> dict[str, str]:
    """{LoRA layer name: weight key} as ComfyUI's `model_lora_keys_unet` builds it for the
    names kohya writes, from a diffusion model's own keys (`lora_unet_` + the key without
    `.weight`, dots as underscores); the tiny Klein's BFL keys by default."""
    if weights is None:
        from diffusers import Flux2Transformer2DModel

        from modules.models.klein_files import to_original_names
        from modules.models.tiny_klein import TINY_KLEIN
        with torch.device("meta"):
            model = Flux2Transformer2DModel.from_config(TINY_KLEIN["transformer"])
        weights = to_original_names(model.state_dict())
    return {"lora_unet_" + k.removesuffix(".weight").replace(".", "_"): k
            for k in weights if k.endswith(".weight")}


def test_the_file_names_bfl_layers_with_q_k_v_fused(saved):
    _, path = saved
    names = set(_updates(path))
    assert all(n.startswith("lora_unet_") for n in names)
    assert "lora_unet_double_blocks_0_img_attn_qkv" in names
    assert "lora_unet_double_blocks_1_txt_attn_qkv" in names
    assert {"lora_unet_double_blocks_0_img_attn_proj", "lora_unet_double_blocks_0_img_mlp_0",
            "lora_unet_double_blocks_0_txt_mlp_2", "lora_unet_single_blocks_1_linear1",
            "lora_unet_single_blocks_1_linear2"} <= names
    assert not any("transformer_blocks" in n or "to_q" in n for n in names)
    assert names <= set(_comfyui_key_map())
    assert len(names) == 2 * 6 + 2 * 2  # per double block: 2 qkv, 2 proj, 2 mlp; single: 2


def test_each_fused_update_is_the_diffusers_layouts_updates_stacked(saved):
    """Per block, the qkv LoRA's update (ComfyUI's alpha / rank · up @ down) is the q, k and v
    LoRAs' updates (peft's scaling · B @ A) in their rows; the text stream's v, not adapted,
    gets exactly zero. The single blocks' fused projections, in (`linear1`) and out
    (`linear2`: the attention and MLP outputs together), are peft's updates as they are."""
    transformer, path = saved
    updates = _updates(path)
    layers = dict(transformer.named_modules())

    def peft_update(path: str) -> torch.Tensor:
        layer = layers[path]
        return layer.scaling["default"] * (layer.lora_B["default"].weight
                                           @ layer.lora_A["default"].weight)
    for block in (0, 1):
        img = updates[f"lora_unet_double_blocks_{block}_img_attn_qkv"]
        want = torch.cat([peft_update(f"transformer_blocks.{block}.attn.to_{p}") for p in "qkv"])
        torch.testing.assert_close(img, want, rtol=1e-6, atol=1e-7)
        txt = updates[f"lora_unet_double_blocks_{block}_txt_attn_qkv"]
        torch.testing.assert_close(
            txt[:32], peft_update(f"transformer_blocks.{block}.attn.add_q_proj"),
            rtol=1e-6, atol=1e-7)
        assert torch.equal(txt[64:], torch.zeros(32, 32))
        torch.testing.assert_close(
            updates[f"lora_unet_single_blocks_{block}_linear1"],
            peft_update(f"single_transformer_blocks.{block}.attn.to_qkv_mlp_proj"),
            rtol=0, atol=0)
        linear2 = peft_update(f"single_transformer_blocks.{block}.attn.to_out")
        assert linear2.shape == (32, 32 + 3 * 32)  # the attention's width + the MLP's
        torch.testing.assert_close(updates[f"lora_unet_single_blocks_{block}_linear2"],
                                   linear2, rtol=0, atol=0)


def test_the_bfl_weights_plus_the_file_read_by_diffusers_are_the_merged_lora(saved, klein_folder,
                                                                             tmp_path):
    """The base in BFL's layout, each layer's update added to the weight ComfyUI's key map
    gives its name, read back by diffusers' from_single_file:
    every weight equals the LoRA merged by peft (each layer's `merge`) into the diffusers model."""
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import save_file

    from modules.models.klein_files import to_original_names
    transformer, path = saved
    base = Flux2Transformer2DModel.from_pretrained(klein_folder, subfolder="transformer",
                                                   local_files_only=True)
    weights = to_original_names(base.state_dict())
    key_map = _comfyui_key_map(weights)
    for name, update in _updates(path).items():
        weights[key_map[name]] = weights[key_map[name]] + update
    file = tmp_path / "patched.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, str(file))
    patched = Flux2Transformer2DModel.from_single_file(
        str(file), config=str(klein_folder), subfolder="transformer", local_files_only=True,
        torch_dtype=torch.float32).state_dict()
    from peft.tuners.tuners_utils import BaseTunerLayer
    tuned = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
    for layer in tuned:
        layer.merge()
    try:
        merged = {k.replace(".base_layer.", "."): v.clone()
                  for k, v in transformer.state_dict().items() if "lora_" not in k}
    finally:
        for layer in tuned:
            layer.unmerge()
    assert merged.keys() == patched.keys()
    for key, value in merged.items():
        torch.testing.assert_close(patched[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_the_lora_tools_read_and_write_the_fused_layout_exactly(saved, klein_folder, tmp_path):
    """convert ComfyUI -> diffusers splits each qkv LoRA into q, k and v (the text stream's
    zero v left out) and back gives the same updates; merged into the folder, the file gives
    what Flux2KleinPipeline.load_lora_weights' converted file gives."""
    from modules.cli.lora import main
    peft, back = tmp_path / "peft.safetensors", tmp_path / "back.safetensors"
    _, path = saved
    assert main(["convert", "--base", str(klein_folder), "--lora", str(path),
                 "--layout", "diffusers", "-o", str(peft)]) == 0
    keys = {k.split(".lora_")[0] for k in load_file(str(peft))}
    assert "transformer.transformer_blocks.0.attn.add_q_proj" in keys
    assert "transformer.transformer_blocks.0.attn.add_v_proj" not in keys
    assert len(keys) == 2 * 9 + 2 * 2
    assert main(["convert", "--base", str(klein_folder), "--lora", str(peft),
                 "--layout", "kohya", "-o", str(back)]) == 0
    original, again = _updates(path), _updates(back)
    assert original.keys() == again.keys()
    for name, update in original.items():
        torch.testing.assert_close(again[name], update, rtol=1e-5, atol=1e-6)


def test_dora_is_refused_up_front_and_at_saving_loha_and_lokr_are_not(klein_folder, tmp_path):
    """DoRA with KOHYA output is refused by the run's checks, naming why (no fused form, and
    its row-norm update on a fused weight's rows is not verified with ComfyUI); saving such a
    transformer anyway is refused too, nothing written. LoHa and LoKr pass the checks (they
    are written unfused, under ComfyUI's `lycoris_` names: tests below)."""
    config = apply_overrides(Config(), ["model.type=KLEIN", "training.adapter=DORA",
                                        "output.formats=[\"KOHYA\"]"])
    problems = {p.path: str(p) for p in family_problems(config)}
    assert problems.keys() == {"training.adapter"}
    assert "fuses q, k and v" in problems["training.adapter"]
    assert "not verified" in problems["training.adapter"]
    for adapter in ("LORA", "LOHA", "LOKR"):
        assert family_problems(apply_overrides(config, [f"training.adapter={adapter}"])) == []
    path = tmp_path / "dora.safetensors"
    with pytest.raises(KohyaError, match="no fused form"):
        save_kohya_lora({"transformer": _lora_transformer(klein_folder, "dora")}, path, None,
                        ModelType.KLEIN)
    assert not path.exists()


def test_a_lora_run_writes_comfyuis_file_beside_the_diffusers_one(tiny_config):
    """2 LoRA steps with KOHYA output on the preset's targets: every layer of the diffusers
    file (peft's lora_alpha / r · B @ A) has its update in the ComfyUI file, q / k / v in their
    rows of the fused qkv, the single blocks' `attn.to_out` as `linear2`; the file says it is
    a Flux.2 Klein LoRA in its metadata."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    from modules.config.loader import load_config
    from modules.models.klein_files import original_key
    from modules.train.trainer import train
    presets = load_config(Path(__file__).resolve().parents[2] / "training_presets" / "klein"
                          / "lora.json").training.lora_target_modules
    assert "to_out" in presets
    result = train(tiny_config("model.type=KLEIN", "model.path=builtin:tiny-klein",
                               "training.max_steps=2", "training.lora_rank=4",
                               "training.lora_alpha=8", "sampling.sampler=EULER",
                               f"training.lora_target_modules={json.dumps(list(presets))}",
                               'output.formats=["DIFFUSERS", "KOHYA"]'))
    final = result.output_dir / "final"
    peft = load_file(str(final / "pytorch_lora_weights.safetensors"))
    with safe_open(str(final / "pytorch_lora_weights.safetensors"), "pt") as f:
        config = json.loads((f.metadata() or {})["lora_adapter_metadata"])
    scale = config["transformer.lora_alpha"] / config["transformer.r"]
    comfy = _updates(final / "lora_kohya.safetensors")
    seen = set()
    for key in peft:
        if ".lora_A." not in key:
            continue
        path = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
        update = scale * peft[key.replace("lora_A", "lora_B")] @ peft[key]
        name, rows = original_key(path + ".weight", update.shape[0])
        fused = comfy["lora_unet_" + name.removesuffix(".weight").replace(".", "_")]
        torch.testing.assert_close(fused[slice(*rows) if rows else slice(None)], update,
                                   rtol=1e-5, atol=1e-7)
        seen.add(name)
    # per double block: 2 qkv, 2 proj, 4 mlp; per single block: linear1 and linear2
    assert len(seen) == len(comfy) == 2 * 8 + 2 * 2
    assert {"single_blocks.0.linear2.weight", "single_blocks.1.linear2.weight"} <= seen
    with safe_open(str(final / "lora_kohya.safetensors"), "pt") as f:
        assert (f.metadata() or {})["modelspec.architecture"] == "flux-2-klein/lora"


def test_diffusers_flux2_loader_reads_the_comfyui_file_as_the_diffusers_one(saved, klein_folder,
                                                                            tmp_path):
    """Flux2KleinPipeline.load_lora_weights also reads BFL-named LoRAs (its converter for
    `diffusion_model.double_blocks…` files): the ComfyUI file and the diffusers file of the
    same LoRA give the same transformer output."""
    from diffusers import Flux2KleinPipeline
    from peft.utils import get_peft_model_state_dict

    from modules.models.kohya import adapter_config
    from tests.lora_tools.test_klein_lora_tools import _forward
    transformer, path = saved
    Flux2KleinPipeline.save_lora_weights(
        save_directory=tmp_path, weight_name="peft.safetensors", safe_serialization=True,
        transformer_lora_layers=get_peft_model_state_dict(transformer,
                                                           save_embedding_layers=False),
        transformer_lora_adapter_metadata=adapter_config(transformer).to_dict())
    outputs = []
    for file in (tmp_path / "peft.safetensors", path):
        pipe = Flux2KleinPipeline.from_pretrained(klein_folder, local_files_only=True)
        pipe.load_lora_weights(str(file.parent), weight_name=file.name)
        outputs.append(_forward(pipe.transformer))
    plain = Flux2KleinPipeline.from_pretrained(klein_folder, local_files_only=True)
    assert not torch.allclose(_forward(plain.transformer), outputs[0], atol=1e-4)
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)


def _comfyui_loaded(comfyui, transformer, lora: dict[str, torch.Tensor], caplog):
    """ComfyUI's own loading of the file's tensors `lora` onto a Flux.2 model (its class, the
    transformer's BFL weight names under `diffusion_model.`): comfy.lora's model_lora_keys_unet
    and load_lora; fails on any tensor it leaves "not loaded". (key map, patches, {weight key:
    its BFL tensor})."""
    import logging
    from types import SimpleNamespace

    from modules.models.klein_files import to_original_names
    config = transformer.config
    model = comfyui.model_base.Flux2.__new__(comfyui.model_base.Flux2)
    torch.nn.Module.__init__(model)
    model.model_config = SimpleNamespace(unet_config={
        "image_model": "flux2", "depth": config.num_layers,
        "depth_single_blocks": config.num_single_layers, "mlp_ratio": config.mlp_ratio,
        "hidden_size": config.num_attention_heads * config.attention_head_dim})
    base = {k.replace(".base_layer", ""): v for k, v in transformer.state_dict().items()
            if "lora_" not in k and "lokr_" not in k and "hada_" not in k}
    weights = {"diffusion_model." + k: v for k, v in to_original_names(base).items()}
    model.state_dict = lambda: {k: None for k in weights}
    key_map = comfyui.lora.model_lora_keys_unet(model, {})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        patches = comfyui.lora.load_lora(lora, key_map)
    assert not [r for r in caplog.records if "not loaded" in r.getMessage()]
    return key_map, patches, weights


def test_comfyuis_own_loading_maps_every_key_and_applies_the_update(saved, comfyui, caplog):
    """ComfyUI's own code (skipped without `pytest --comfyui=PATH`): comfy.lora's
    model_lora_keys_unet on a Flux.2 model (its class, the tiny Klein's BFL weight names under
    `diffusion_model.`), load_lora and calculate_weight map every tensor of the file and add
    to each weight the update computed here (each fused `qkv` the q, k and v updates stacked,
    checked above against peft's)."""
    transformer, path = saved
    key_map, patches, weights = _comfyui_loaded(comfyui, transformer, load_file(str(path)),
                                                caplog)
    expected = {key_map[name]: update for name, update in _updates(path).items()}
    assert set(patches) == set(expected)
    for key, update in expected.items():
        applied = comfyui.lora.calculate_weight([(1.0, patches[key], 1.0, None, None)],
                                                torch.zeros(weights[key].shape), key)
        torch.testing.assert_close(applied, update, rtol=1e-5, atol=1e-6, msg=key)


# --- LoHa and LoKr: unfused, under ComfyUI's names for diffusers-named Flux layers ----------
ADAPTERS = {"loha": ("training.adapter=LOHA",),
            "lokr": ("training.adapter=LOKR", "training.lokr_factor=4")}


@pytest.fixture(scope="module", params=list(ADAPTERS))
def lycoris(request, klein_folder, tmp_path_factory):
    """The tiny transformer with the trainer's LoHa / LoKr (rank 4, alpha 6) on the preset's
    targets, every adapter tensor random, saved as the KOHYA file: (the transformer, the file,
    each layer's peft update `get_delta_weight`). No training run: the adapters are set."""
    from pathlib import Path

    from modules.config.loader import load_config
    from modules.models.families import family_of
    from modules.models.kohya import adapter_layers
    from modules.train.recipe.adapters import add_adapter
    preset = load_config(Path(__file__).resolve().parents[2] / "training_presets" / "klein"
                         / "lora.json")
    config = apply_overrides(preset, ["training.lora_rank=4", "training.lora_alpha=6",
                                      *ADAPTERS[request.param]])
    family = family_of(ModelType.KLEIN)
    transformer = family.load_folder(klein_folder, None, torch.float32).denoiser
    transformer.requires_grad_(False)
    add_adapter(transformer, config, denoiser=True, scope=family.lora_scope)
    generator = torch.Generator().manual_seed(5)
    for param in transformer.parameters():
        if param.requires_grad:
            param.data = torch.randn(param.shape, generator=generator) * 0.2
    path = tmp_path_factory.mktemp(f"klein-{request.param}") / "lycoris.safetensors"
    save_kohya_lora({"transformer": transformer}, path, None, ModelType.KLEIN)
    deltas = {p: layer.get_delta_weight("default").detach()
              for p, layer in adapter_layers(transformer).items()}
    return transformer, path, deltas


def _comfyui_flux_lycoris_map(config) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """{LyCORIS layer name: (BFL weight key, its rows or None: all)} as ComfyUI maps
    diffusers-named Flux layers (comfy/lora.py `model_lora_keys_unet` for Flux models:
    `lycoris_` + the diffusers path with "_", onto comfy/utils.py `flux_to_diffusers`' BFL
    keys), written out here for Flux.2's layers from what that map documents: q, k and v of
    each stream at rows (0, h), (h, 2h), (2h, 3h) of its `qkv` (h the hidden size), the rest
    whole."""
    h = config.num_attention_heads * config.attention_head_dim
    out: dict[str, tuple[str, tuple[int, int] | None]] = {}
    for i in range(config.num_layers):
        for stream, names in (("img", ("to_q", "to_k", "to_v")),
                              ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"))):
            for j, name in enumerate(names):
                out[f"transformer_blocks.{i}.attn.{name}"] = (
                    f"double_blocks.{i}.{stream}_attn.qkv.weight", (j * h, (j + 1) * h))
        for ours, theirs in (("attn.to_out.0", "img_attn.proj"), ("attn.to_add_out",
                                                                   "txt_attn.proj"),
                             ("ff.linear_in", "img_mlp.0"), ("ff.linear_out", "img_mlp.2"),
                             ("ff_context.linear_in", "txt_mlp.0"),
                             ("ff_context.linear_out", "txt_mlp.2")):
            out[f"transformer_blocks.{i}.{ours}"] = (f"double_blocks.{i}.{theirs}.weight", None)
    for i in range(config.num_single_layers):
        out[f"single_transformer_blocks.{i}.attn.to_qkv_mlp_proj"] = (
            f"single_blocks.{i}.linear1.weight", None)
        out[f"single_transformer_blocks.{i}.attn.to_out"] = (f"single_blocks.{i}.linear2.weight",
                                                              None)
    return {"lycoris_" + k.replace(".", "_"): v for k, v in out.items()}


def _lycoris_update(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """One layer's update from the file's tensors by LyCORIS's definitions (what ComfyUI's
    LoHa / LoKr adapters compute): LoHa alpha / rank · (w1_a @ w1_b) * (w2_a @ w2_b); LoKr
    kron(w1, w2), each factor whole or a product, scaled by alpha / rank (rank: w2_b's, else
    w1_b's) where a factor is a product and not at all where both are whole."""
    t = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
    alpha = float(t["alpha"])
    if "hada_w1_a" in t:
        return (alpha / t["hada_w1_b"].shape[0] * (t["hada_w1_a"] @ t["hada_w1_b"])
                * (t["hada_w2_a"] @ t["hada_w2_b"]))
    w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
    w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
    rank = (t["lokr_w2_b"].shape[0] if "lokr_w2_b" in t
            else t["lokr_w1_b"].shape[0] if "lokr_w1_b" in t else None)
    return torch.kron(w1, w2) * (alpha / rank if rank else 1.0)


def test_loha_and_lokr_name_each_layer_as_comfyuis_flux_map_does(lycoris):
    """The file names every adapted layer `lycoris_` + its diffusers path with "_", exactly the
    names ComfyUI's documented map gives those layers, and where that map puts each (a BFL key
    and, for q / k / v, its rows of the fused `qkv`) is where Tempera's diffusion-model file
    holds it (klein_files.original_key); each layer's update from the file (its alpha over
    its rank) is peft's."""
    from modules.models.klein_files import original_key
    transformer, path, deltas = lycoris
    tensors = load_file(str(path))
    names = {k.rsplit(".", 1)[0] for k in tensors}
    assert names == {"lycoris_" + p.replace(".", "_") for p in deltas}
    # the preset's targets: per double block 8 attention and 4 feed-forward layers, per
    # single block its fused in and out projections
    assert len(deltas) == 2 * 12 + 2 * 2
    documented = _comfyui_flux_lycoris_map(transformer.config)
    assert names <= set(documented)
    for module_path, delta in deltas.items():
        name = "lycoris_" + module_path.replace(".", "_")
        assert f"{name}.alpha" in tensors and tensors[f"{name}.alpha"].dtype == torch.float32
        assert documented[name] == original_key(module_path + ".weight", delta.shape[0])
        torch.testing.assert_close(_lycoris_update(tensors, name), delta, rtol=1e-5, atol=1e-6)


def test_comfyuis_own_loading_applies_loha_and_lokr_as_built(lycoris, comfyui, caplog):
    """ComfyUI's own code (skipped without `pytest --comfyui=PATH`) maps every tensor of the
    LoHa / LoKr file onto the BFL weights and applies to each layer, q / k / v at their rows
    of the fused `qkv`, exactly peft's update; the other rows of the fused weight unchanged."""
    transformer, path, deltas = lycoris
    key_map, patches, weights = _comfyui_loaded(comfyui, transformer, load_file(str(path)),
                                                caplog)
    assert len(patches) == len(deltas)
    for module_path, delta in deltas.items():
        target = key_map["lycoris_" + module_path.replace(".", "_")]
        key, offset = target if isinstance(target, tuple) else (target, None)
        applied = comfyui.lora.calculate_weight([(1.0, patches[target], 1.0, offset, None)],
                                                torch.zeros(weights[key].shape), key)
        rows = slice(offset[1], offset[1] + offset[2]) if offset else slice(None)
        torch.testing.assert_close(applied[rows], delta, rtol=1e-4, atol=1e-6, msg=module_path)
        untouched = torch.ones(applied.shape[0], dtype=torch.bool)
        untouched[rows] = False
        assert not applied[untouched].any(), module_path


def test_diffusers_flux2_loader_applies_the_lokr_file_and_refuses_the_loha_one(lycoris,
                                                                              klein_folder):
    """Flux2KleinPipeline.load_lora_weights reads LyCORIS's Flux.2 LoKr names
    (`_convert_lycoris_flux2_lokr_to_diffusers`): every layer of the LoKr file gets peft's
    update as built. It has no LoHa reader: the LoHa file is refused, nothing loaded (such a
    file is ComfyUI's; docs/klein.md)."""
    from diffusers import Flux2KleinPipeline

    from tests.models.test_zimage import assert_lokr_loaded_as
    _, path, deltas = lycoris
    pipe = Flux2KleinPipeline.from_pretrained(klein_folder, local_files_only=True)
    if not any(".lokr_" in k for k in load_file(str(path))):  # the LoHa file
        with pytest.raises(ValueError):
            pipe.load_lora_weights(str(path))
        assert not any(hasattr(m, "hada_w1_a") for m in pipe.transformer.modules())
        return
    pipe.load_lora_weights(str(path))
    assert_lokr_loaded_as(pipe.transformer, deltas)


def test_a_loha_run_writes_its_kohya_file_in_comfyuis_lycoris_layout(tiny_config):
    """1 LoHa step with KOHYA output only (LoHa has no diffusers Klein reader): the run is
    accepted and writes `lora_kohya.safetensors` with every layer of the preset's targets under
    its `lycoris_` name, each with its LoHa factors and a float32 alpha (rank 4, alpha 8)."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from modules.config.loader import load_config
    from modules.models.tiny_klein import TINY_KLEIN
    from modules.train.trainer import train
    targets = load_config(Path(__file__).resolve().parents[2] / "training_presets" / "klein"
                          / "lora.json").training.lora_target_modules
    result = train(tiny_config("model.type=KLEIN", "model.path=builtin:tiny-klein",
                               "training.max_steps=1", "training.adapter=LOHA",
                               "training.lora_rank=4", "training.lora_alpha=8",
                               "sampling.sampler=EULER", 'output.formats=["KOHYA"]',
                               f"training.lora_target_modules={json.dumps(list(targets))}"))
    tensors = load_file(str(result.output_dir / "final" / "lora_kohya.safetensors"))
    documented = _comfyui_flux_lycoris_map(SimpleNamespace(**TINY_KLEIN["transformer"]))
    names = {k.rsplit(".", 1)[0] for k in tensors}
    assert names == set(documented)  # the preset adapts every layer ComfyUI's map names
    for name in names:
        assert {k.rsplit(".", 1)[1] for k in tensors if k.startswith(name + ".")} == {
            "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}
        assert float(tensors[f"{name}.alpha"]) == 8.0
