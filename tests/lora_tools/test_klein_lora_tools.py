"""`tempera-lora` on the tiny Flux.2 Klein (builtin:tiny-klein): each result checked against a
computation made here (W + weight · scale · B @ A from the file's own tensors, torch's SVD),
diffusers' own loading of what is written (Flux2Transformer2DModel.from_pretrained and
.from_single_file of ComfyUI's BFL-layout file) and peft's LoRA applied at run time by
Flux2KleinPipeline.load_lora_weights; a Klein LoRA given to another family (and the reverse)
refused naming both."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modules.cli.lora import main
from modules.config.schema import ModelType
from modules.model_types import MODEL_TYPES
from modules.models.tiny import ensure_builtin_model

TRANSFORMER_FILE = "transformer/diffusion_pytorch_model.safetensors"
# the trainer's preset targets: both blocks' attention (q, k, v, out, the caption stream's
# projections), the feed-forwards and the single blocks' fused projections, in and out (their
# `attn.to_out`, BFL's `linear2`; the double blocks' `attn.to_out` is a ModuleList)
TARGETS = (r"(?:single_)?transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|"
           r"add_k_proj|add_v_proj|to_add_out|to_qkv_mlp_proj)|ff\.linear_in|"
           r"ff_context\.linear_out)|single_transformer_blocks\.\d+\.attn\.to_out")


@pytest.fixture(scope="module")
def klein_folder(tempera_cache):
    return ensure_builtin_model(MODEL_TYPES[ModelType.KLEIN].builtin, tempera_cache)


def _lora_transformer(folder: Path, seed: int, rank: int, alpha: float):
    from diffusers import Flux2Transformer2DModel
    from peft import LoraConfig
    transformer = Flux2Transformer2DModel.from_pretrained(folder, subfolder="transformer",
                                                          local_files_only=True)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(seed)
    for key, param in transformer.named_parameters():
        if "lora_" in key:
            param.data = torch.randn(param.shape, generator=generator) * 0.1
    return transformer


@pytest.fixture(scope="module")
def files(klein_folder, tmp_path_factory):
    """Two LoRAs (ranks 4 and 2, alphas 8 and 2) written as the trainer writes Klein's:
    Flux2KleinPipeline.save_lora_weights with peft's metadata."""
    from diffusers import Flux2KleinPipeline
    from peft.utils import get_peft_model_state_dict

    from modules.models.kohya import adapter_config
    out = tmp_path_factory.mktemp("klein-loras")
    for name, seed, rank, alpha in (("a", 1, 4, 8.0), ("b", 2, 2, 2.0)):
        transformer = _lora_transformer(klein_folder, seed, rank, alpha)
        Flux2KleinPipeline.save_lora_weights(
            save_directory=out, weight_name=f"{name}.safetensors", safe_serialization=True,
            transformer_lora_layers=get_peft_model_state_dict(transformer,
                                                               save_embedding_layers=False),
            transformer_lora_adapter_metadata=adapter_config(transformer).to_dict())
    return {"base": Path(klein_folder), "a": out / "a.safetensors", "b": out / "b.safetensors",
            "dir": out}


def _updates(path: Path) -> dict[str, torch.Tensor]:
    """{module path: lora_alpha / r · B @ A} of a diffusers/peft file, read by hand."""
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        config = json.loads((f.metadata() or {})["lora_adapter_metadata"])
    tensors = load_file(str(path))
    scale = config["transformer.lora_alpha"] / config["transformer.r"]
    assert not config["transformer.rank_pattern"]
    return {k.removeprefix("transformer.").removesuffix(".lora_A.weight"):
            scale * tensors[k.replace("lora_A", "lora_B")] @ tensors[k]
            for k in tensors if ".lora_A." in k}


def _forward(transformer) -> torch.Tensor:
    """One fixed call as Flux2KleinPipeline makes it (the family's own arguments)."""
    from modules.models.families import TextEmbeddings, family_of
    family = family_of(ModelType.KLEIN)
    generator = torch.Generator().manual_seed(0)
    noisy = torch.randn(1, 32, 8, 8, generator=generator)
    captions = TextEmbeddings(torch.randn(1, 12, 48, generator=generator))
    conditioning = family.conditioning(captions, {}, 64, 64)
    with torch.no_grad():
        return family.predict(transformer, noisy, torch.tensor([400]), conditioning)


@pytest.fixture(scope="module")
def merged(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("klein-merged") / "model"
    assert main(["merge", "--base", str(files["base"]), "--lora", f"{files['a']}:0.7",
                 "-o", str(out)]) == 0
    return out


def test_merge_into_a_klein_folder_is_w_plus_the_weighted_update(files, merged):
    updates = _updates(files["a"])
    base = load_file(str(files["base"] / TRANSFORMER_FILE))
    result = load_file(str(merged / TRANSFORMER_FILE))
    assert result.keys() == base.keys()
    for key, weight in base.items():
        name = key.removesuffix(".weight")
        if name in updates:
            torch.testing.assert_close(result[key], weight + 0.7 * updates[name],
                                       rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(result[key], weight), key
    assert len(updates) == 2 * 10 + 2 * 2  # 2 double blocks x 10 layers, 2 single x 2
    for same in ("model_index.json", "text_encoder/model.safetensors", "transformer/config.json"):
        assert (merged / same).read_bytes() == (files["base"] / same).read_bytes()


def test_merged_folder_in_diffusers_equals_the_lora_applied_at_run_time(files, merged):
    """diffusers' loading of the merged folder gives what peft's LoRA (loaded by
    Flux2KleinPipeline.load_lora_weights at weight 0.7, not fused) gives on the base."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel
    pipe = Flux2KleinPipeline.from_pretrained(files["base"], local_files_only=True)
    pipe.load_lora_weights(str(files["dir"]), weight_name=files["a"].name, adapter_name="a")
    pipe.set_adapters(["a"], adapter_weights=[0.7])
    at_run_time = _forward(pipe.transformer)
    ours = Flux2Transformer2DModel.from_pretrained(merged, subfolder="transformer",
                                                   local_files_only=True)
    plain = Flux2Transformer2DModel.from_pretrained(files["base"], subfolder="transformer",
                                                    local_files_only=True)
    torch.testing.assert_close(_forward(ours), at_run_time, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(_forward(plain), at_run_time, atol=1e-4)  # the LoRA does act


def _merge_into_bfl_file(files, tmp_path: Path, lora: str):
    """The base transformer written as ComfyUI's BFL file, and `lora` ("path:weight") merged
    into it by the tools: (the base transformer, that file, the merged one)."""
    from diffusers import Flux2Transformer2DModel

    from modules.models.klein_files import save_transformer_file
    plain = Flux2Transformer2DModel.from_pretrained(files["base"], subfolder="transformer",
                                                    local_files_only=True)
    comfy = save_transformer_file(plain, tmp_path / "klein.safetensors")
    out = tmp_path / "klein_merged.safetensors"
    assert main(["merge", "--base", str(comfy), "--config-folder", str(files["base"]),
                 "--lora", lora, "-o", str(out)]) == 0
    return plain, comfy, out


def test_merge_into_comfyuis_bfl_file_and_extract_from_two(files, merged, tmp_path):
    """ComfyUI's diffusion-model file (BFL names, q/k/v fused in `qkv`): each row block is its
    projection plus its update, diffusers' from_single_file reads it as the merged folder's
    transformer, and the folder merged straight into a .safetensors streams the same file.
    Extracting from two such files reads q/k/v from their rows and the final modulation with
    its halves swapped back: a change made to it comes out in diffusers' order."""
    from diffusers import Flux2Transformer2DModel

    from modules.models.klein_files import save_transformer_file
    plain, comfy, out = _merge_into_bfl_file(files, tmp_path, f"{files['a']}:0.7")
    updates, before, after = _updates(files["a"]), load_file(str(comfy)), load_file(str(out))
    qkv = "double_blocks.1.txt_attn.qkv.weight"
    expected = torch.cat([before[qkv][i * 32:(i + 1) * 32]
                          + 0.7 * updates[f"transformer_blocks.1.attn.add_{p}_proj"]
                          for i, p in enumerate("qkv")])
    torch.testing.assert_close(after[qkv], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after["single_blocks.0.linear1.weight"],
                               before["single_blocks.0.linear1.weight"]
                               + 0.7 * updates["single_transformer_blocks.0.attn.to_qkv_mlp_proj"])
    torch.testing.assert_close(after["single_blocks.1.linear2.weight"],
                               before["single_blocks.1.linear2.weight"]
                               + 0.7 * updates["single_transformer_blocks.1.attn.to_out"])
    loaded = Flux2Transformer2DModel.from_single_file(
        str(out), config=str(files["base"]), subfolder="transformer", local_files_only=True,
        torch_dtype=torch.float32)
    reference = Flux2Transformer2DModel.from_pretrained(merged, subfolder="transformer",
                                                        local_files_only=True).state_dict()
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=key)
    from_folder = tmp_path / "from_folder.safetensors"
    assert main(["merge", "--base", str(files["base"]), "--lora", f"{files['a']}:0.7",
                 "-o", str(from_folder)]) == 0
    written = load_file(str(from_folder))
    assert written.keys() == after.keys()
    assert all(torch.equal(written[k], v) for k, v in after.items())
    # a tuned file whose final modulation (stored swapped) and q projection changed by rank 1
    generator = torch.Generator().manual_seed(7)
    state = plain.state_dict()
    changes = {key: torch.randn(state[key].shape[0], 1, generator=generator)
               @ torch.randn(1, state[key].shape[1], generator=generator)
               for key in ("norm_out.linear.weight", "transformer_blocks.0.attn.to_q.weight")}
    plain.load_state_dict({k: v + changes.get(k, 0) for k, v in state.items()})
    tuned = save_transformer_file(plain, tmp_path / "klein_tuned.safetensors")
    extracted = tmp_path / "extracted.safetensors"
    assert main(["extract", "--base", str(comfy), "--tuned", str(tuned), "--config-folder",
                 str(files["base"]), "--rank", "1", "--layout", "diffusers",
                 "-o", str(extracted)]) == 0
    got = _updates(extracted)
    assert got.keys() == {k.removesuffix(".weight") for k in changes}
    for key, change in changes.items():
        torch.testing.assert_close(got[key.removesuffix(".weight")], change,
                                   rtol=1e-4, atol=1e-5)
    # and merged back into the base file, the extracted LoRA gives the tuned file
    back = tmp_path / "back.safetensors"
    assert main(["merge", "--base", str(comfy), "--config-folder", str(files["base"]),
                 "--lora", str(extracted), "-o", str(back)]) == 0
    want = load_file(str(tuned))
    for key, value in load_file(str(back)).items():
        torch.testing.assert_close(value, want[key], rtol=1e-4, atol=1e-5, msg=key)


def test_merge_several_klein_loras_is_the_weighted_sum(files, tmp_path):
    out = tmp_path / "ab.safetensors"
    assert main(["merge-loras", "--base", str(files["base"]), "--lora", f"{files['a']}:0.5",
                 "--lora", f"{files['b']}:-0.3", "--layout", "diffusers", "-o", str(out)]) == 0
    a, b, ab = _updates(files["a"]), _updates(files["b"]), _updates(out)
    assert ab.keys() == a.keys() == b.keys()
    for name in ab:
        torch.testing.assert_close(ab[name], 0.5 * a[name] - 0.3 * b[name],
                                   rtol=1e-5, atol=1e-6)


def test_extract_from_two_klein_folders_keeps_what_svd_says(files, merged, tmp_path):
    out = tmp_path / "extracted.safetensors"
    assert main(["extract", "--base", str(files["base"]), "--tuned", str(merged), "--rank", "2",
                 "--layout", "diffusers", "-o", str(out)]) == 0
    base = load_file(str(files["base"] / TRANSFORMER_FILE))
    tuned = load_file(str(merged / TRANSFORMER_FILE))
    got = _updates(out)
    assert got.keys() == _updates(files["a"]).keys()  # exactly the layers the LoRA changed
    for name, update in got.items():
        diff = (tuned[name + ".weight"] - base[name + ".weight"]).double()
        u, s, vh = torch.linalg.svd(diff)
        torch.testing.assert_close(update.double(), (u[:, :2] * s[:2]) @ vh[:2],
                                   rtol=1e-4, atol=1e-6)


def test_resize_klein_lora_reports_the_svd_error(files, tmp_path):
    from modules.lora_tools.operations import run_tool
    out = tmp_path / "small.safetensors"
    report = run_tool("resize", base=files["base"], loras=[(files["a"], 1.0)], rank=1,
                      output=out)
    for name, update in _updates(files["a"]).items():
        s = torch.linalg.svdvals(update.double())
        expected = float((s[1:] ** 2).sum().sqrt() / (s ** 2).sum().sqrt())
        assert report.per_layer[f"transformer.{name}"] == pytest.approx(expected, rel=1e-6)
    assert {t.shape[0] for k, t in load_file(str(out)).items() if "lora_A" in k} == {1}


def test_mixing_families_is_refused_naming_both(files, tempera_cache, tmp_path, capsys):
    """A Klein LoRA given to Z-Image and to SDXL, a Z-Image LoRA given to Klein (the two share
    the diffusers layout's `transformer.`) and an SD one (kohya's `lora_unet_` too): each
    refused with exit 2 naming both families, nothing written."""
    zimage = ensure_builtin_model(MODEL_TYPES[ModelType.ZIMAGE].builtin, tempera_cache)
    sdxl = ensure_builtin_model(MODEL_TYPES[ModelType.SDXL].builtin, tempera_cache)
    out = tmp_path / "out"
    for base, label in ((zimage, "Z-Image (ZIMAGE)"), (sdxl, "Stable Diffusion XL (SDXL)")):
        assert main(["merge", "--base", str(base), "--lora", str(files["a"]),
                     "-o", str(out)]) == 2
        error = capsys.readouterr().err
        assert "is a Flux.2 Klein LoRA" in error and label in error, error
    for name in ("transformer.layers.0.attention.to_q", "diffusion_model.layers.0.attention.to_q"):
        lora = tmp_path / "zimage_lora.safetensors"
        down, up = (".lora_A.weight", ".lora_B.weight") if name.startswith("transformer") else (
            ".lora_down.weight", ".lora_up.weight")
        save_file({name + down: torch.zeros(2, 32), name + up: torch.zeros(32, 2)}, str(lora))
        assert main(["convert", "--base", str(files["base"]), "--lora", str(lora),
                     "--layout", "diffusers", "-o", str(out)]) == 2
        error = capsys.readouterr().err
        assert "is a Z-Image LoRA" in error and "Flux.2 Klein (KLEIN)" in error, error
        lora.unlink()
    sd_lora = tmp_path / "sd_lora.safetensors"
    name = "lora_unet_down_blocks_0_attentions_0_proj_in"
    save_file({f"{name}.lora_down.weight": torch.zeros(2, 8),
               f"{name}.lora_up.weight": torch.zeros(8, 2)}, str(sd_lora))
    assert main(["convert", "--base", str(files["base"]), "--lora", str(sd_lora),
                 "--layout", "diffusers", "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert "Stable Diffusion" in error and "Flux.2 Klein (KLEIN)" in error, error
    assert not out.exists()


def test_a_lokr_on_comfyuis_fused_qkv_is_refused_naming_it(files, tmp_path, capsys):
    """ComfyUI's layout fuses q, k and v: the tools split a LoRA there into the three exactly
    (tests/models/test_klein_comfyui_lora.py), but a LoKr of the fused weight has no such split:
    refused naming the layer, nothing written."""
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    lokr = tmp_path / "lokr.safetensors"
    save_file({f"{name}.lokr_w1": torch.randn(4, 4), f"{name}.lokr_w2": torch.randn(24, 8),
               f"{name}.alpha": torch.tensor(1.0)}, str(lokr))
    out = tmp_path / "out.safetensors"
    assert main(["convert", "--base", str(files["base"]), "--lora", str(lokr),
                 "--layout", "diffusers", "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert name in error and "a lokr layer on a fused weight" in error, error
    assert not out.exists()


def test_two_names_adapting_one_layer_are_refused_naming_both(files, tmp_path, capsys):
    """A file (not the trainer's) with a LoRA of the fused `qkv` and a `lycoris_` layer of its
    q: both adapt the double block's `to_q`, and reading it refuses naming both, where one would
    otherwise have replaced the other without a word; nothing written."""
    fused, alone = "lora_unet_double_blocks_0_img_attn_qkv", "lycoris_transformer_blocks_0_attn_to_q"
    both = tmp_path / "both.safetensors"
    save_file({f"{fused}.lora_down.weight": torch.randn(2, 32),
               f"{fused}.lora_up.weight": torch.randn(96, 2), f"{fused}.alpha": torch.tensor(2.0),
               f"{alone}.lora_down.weight": torch.randn(2, 32),
               f"{alone}.lora_up.weight": torch.randn(32, 2), f"{alone}.alpha": torch.tensor(2.0)},
              str(both))
    out = tmp_path / "out.safetensors"
    assert main(["convert", "--base", str(files["base"]), "--lora", str(both),
                 "--layout", "diffusers", "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert f"{fused} and {alone} both adapt" in error or f"{alone} and {fused} both adapt" in error
    assert "transformer_blocks.0.attn.to_q" in error, error
    assert not out.exists()


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_a_klein_loha_or_lokr_file_merges_exactly_and_is_refused_where_undefined(
        files, tmp_path, capsys, kind):
    """The trainer's Klein LoHa / LoKr KOHYA file (each layer under ComfyUI's `lycoris_` name,
    tests/models/test_klein_comfyui_lora.py): merged into the folder and into ComfyUI's BFL
    diffusion-model file, every weight is the base plus 0.5 x peft's update of its layer (q / k
    / v at their rows of `qkv`); merge-loras, resize and convert refuse it naming the kind and
    why, as for Z-Image's LoKr, nothing written."""
    from diffusers import Flux2Transformer2DModel
    from peft import LoHaConfig, LoKrConfig

    from modules.models.klein_files import to_original_names
    from modules.models.kohya import adapter_layers, save_kohya_lora
    transformer = Flux2Transformer2DModel.from_pretrained(files["base"], subfolder="transformer",
                                                          local_files_only=True)
    plain = {k: v.clone() for k, v in transformer.state_dict().items()}
    transformer.add_adapter(LoHaConfig(r=4, alpha=6, target_modules=TARGETS) if kind == "loha"
                            else LoKrConfig(r=4, alpha=6, target_modules=TARGETS,
                                            decompose_factor=4))
    generator = torch.Generator().manual_seed(3)
    for key, param in transformer.named_parameters():
        if "hada_" in key or "lokr_" in key:
            param.data = torch.randn(param.shape, generator=generator) * 0.2
    lycoris = save_kohya_lora({"transformer": transformer}, tmp_path / f"{kind}.safetensors",
                              None, ModelType.KLEIN)
    assert all(k.startswith("lycoris_") for k in load_file(str(lycoris)))
    want = dict(plain)
    for path, layer in adapter_layers(transformer).items():
        want[f"{path}.weight"] = plain[f"{path}.weight"] + 0.5 * layer.get_delta_weight(
            "default").detach()
    folder = tmp_path / "merged"
    assert main(["merge", "--base", str(files["base"]), "--lora", f"{lycoris}:0.5",
                 "-o", str(folder)]) == 0
    for key, value in load_file(str(folder / TRANSFORMER_FILE)).items():
        torch.testing.assert_close(value, want[key], rtol=1e-5, atol=1e-6, msg=key)
    _, _, out = _merge_into_bfl_file(files, tmp_path, f"{lycoris}:0.5")
    bfl = to_original_names(want)
    for key, value in load_file(str(out)).items():
        torch.testing.assert_close(value, bfl[key], rtol=1e-5, atol=1e-6, msg=key)
    capsys.readouterr()
    refused = tmp_path / "refused.safetensors"
    for tool in (["merge-loras"], ["resize", "--rank", "2"], ["convert", "--layout", "diffusers"]):
        assert main([tool[0], "--base", str(files["base"]), "--lora", str(lycoris), *tool[1:],
                     "-o", str(refused)]) == 2
        error = capsys.readouterr().err
        assert f"{kind.upper()} layers cannot be used by {tool[0]}" in error, error
        assert not refused.exists()
