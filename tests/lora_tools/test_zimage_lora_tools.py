"""`tempera-lora` on the tiny Z-Image (the session's `zimage_folder`): each result checked
against a computation made here (W + weight · alpha / rank · up @ down from the file's own
tensors, torch's singular values), diffusers' own ZImageTransformer2DModel loading of what is
written, and peft's LoRA applied at run time by diffusers' ZImagePipeline.load_lora_weights."""
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
TARGETS = r"layers\.\d+\.(attention\.(to_q|to_k|to_v|to_out\.0)|feed_forward\.w[123])"


def _lora_transformer(folder: Path, seed: int, rank: int, alpha: float):
    """The tiny transformer with a LoRA on its main blocks' attention and feed-forward (the
    trainer's scope), random non-zero factors."""
    from diffusers import ZImageTransformer2DModel
    from peft import LoraConfig
    transformer = ZImageTransformer2DModel.from_pretrained(folder, subfolder="transformer",
                                                           local_files_only=True)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(seed)
    for key, param in transformer.named_parameters():
        if "lora_" in key:
            param.data = torch.randn(param.shape, generator=generator) * 0.1
    return transformer


@pytest.fixture(scope="module")
def files(zimage_folder, tmp_path_factory):
    """Two LoRAs written by the trainer's own savers (kohya: ComfyUI's layout; diffusers:
    ZImagePipeline.save_lora_weights with peft's metadata), no training run needed."""
    from diffusers import ZImagePipeline
    from peft.utils import get_peft_model_state_dict

    from modules.models.kohya import adapter_config, save_kohya_lora
    out = tmp_path_factory.mktemp("zimage-loras")
    first = _lora_transformer(zimage_folder, 1, 4, 8.0)
    save_kohya_lora({"transformer": first}, out / "a_kohya.safetensors", None, ModelType.ZIMAGE)
    second = _lora_transformer(zimage_folder, 2, 2, 2.0)
    ZImagePipeline.save_lora_weights(
        save_directory=out, weight_name="b_peft.safetensors", safe_serialization=True,
        transformer_lora_layers=get_peft_model_state_dict(second),
        transformer_lora_adapter_metadata=adapter_config(second).to_dict())
    return {"base": Path(zimage_folder), "a": out / "a_kohya.safetensors",
            "b": out / "b_peft.safetensors", "dir": out}


def _updates(path: Path) -> dict[str, torch.Tensor]:
    """{module path: alpha / rank · up @ down} of a Z-Image kohya file, read by hand."""
    tensors = load_file(str(path))
    out = {}
    for key in tensors:
        if key.endswith(".lora_down.weight"):
            name = key.removesuffix(".lora_down.weight")
            down, up = tensors[key], tensors[f"{name}.lora_up.weight"]
            alpha = float(tensors[f"{name}.alpha"])
            out[name.removeprefix("diffusion_model.")] = alpha / down.shape[0] * (up @ down)
    return out


def _peft_updates(path: Path) -> dict[str, torch.Tensor]:
    """{module path: lora_alpha / r · B @ A} of a diffusers/peft file, read by hand."""
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        config = json.loads((f.metadata() or {})["lora_adapter_metadata"])
    tensors = load_file(str(path))
    scale = config["transformer.lora_alpha"] / config["transformer.r"]
    return {k.removeprefix("transformer.").removesuffix(".lora_A.weight"):
            scale * tensors[k.replace("lora_A", "lora_B")] @ tensors[k]
            for k in tensors if ".lora_A." in k}


@pytest.fixture(scope="module")
def merged(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("zimage-merged") / "model"
    assert main(["merge", "--base", str(files["base"]), "--lora", f"{files['a']}:0.7",
                 "-o", str(out)]) == 0
    return out


def _forward(transformer) -> torch.Tensor:
    """One fixed call as ZImagePipeline makes it: (C, 1, H, W) latents, 1 - sigma, captions."""
    generator = torch.Generator().manual_seed(0)
    latents = [torch.randn(16, 1, 8, 8, generator=generator)]
    caption = [torch.randn(7, 32, generator=generator)]
    with torch.no_grad():
        return transformer(latents, torch.tensor([0.4]), caption).sample[0]


def test_merge_into_a_zimage_folder_is_w_plus_the_weighted_update(files, merged):
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
    assert len(updates) == 2 * 7  # 2 main blocks x q, k, v, out, w1, w2, w3
    for same in ("model_index.json", "text_encoder/model.safetensors", "transformer/config.json"):
        assert (merged / same).read_bytes() == (files["base"] / same).read_bytes()


def test_merged_folder_in_diffusers_equals_the_lora_applied_at_run_time(files, merged):
    """diffusers' own loading of the merged folder gives what peft's LoRA (the peft file,
    converted from the kohya one by the tool, loaded by ZImagePipeline.load_lora_weights at
    weight 0.7, not fused) gives on the base."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    converted = files["dir"] / "a_converted.safetensors"
    assert main(["convert", "--base", str(files["base"]), "--lora", str(files["a"]),
                 "--layout", "diffusers", "-o", str(converted)]) == 0
    pipe = ZImagePipeline.from_pretrained(files["base"], local_files_only=True)
    pipe.load_lora_weights(str(files["dir"]), weight_name=converted.name, adapter_name="a")
    pipe.set_adapters(["a"], adapter_weights=[0.7])
    at_run_time = _forward(pipe.transformer)
    ours = ZImageTransformer2DModel.from_pretrained(merged, subfolder="transformer",
                                                    local_files_only=True)
    plain = ZImageTransformer2DModel.from_pretrained(files["base"], subfolder="transformer",
                                                     local_files_only=True)
    torch.testing.assert_close(_forward(ours), at_run_time, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(_forward(plain), at_run_time, atol=1e-4)  # the LoRA does act


def test_merge_into_comfyui_diffusion_model_file(files, merged, tmp_path):
    """ComfyUI's split file (original names, q/k/v fused in attention.qkv): each row block is
    its projection plus its update, and diffusers' from_single_file reads it as the merged
    folder's transformer."""
    from diffusers import ZImageTransformer2DModel

    from modules.models.zimage_files import save_transformer_file
    plain = ZImageTransformer2DModel.from_pretrained(files["base"], subfolder="transformer",
                                                     local_files_only=True)
    comfy = save_transformer_file(plain, tmp_path / "z_image.safetensors")
    out = tmp_path / "z_image_merged.safetensors"
    assert main(["merge", "--base", str(comfy), "--config-folder", str(files["base"]),
                 "--lora", f"{files['a']}:0.7", "-o", str(out)]) == 0
    updates, before, after = _updates(files["a"]), load_file(str(comfy)), load_file(str(out))
    qkv = "layers.1.attention.qkv.weight"
    expected = torch.cat([before[qkv][i * 32:(i + 1) * 32]
                          + 0.7 * updates[f"layers.1.attention.to_{p}"]
                          for i, p in enumerate("qkv")])
    torch.testing.assert_close(after[qkv], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(after["layers.0.attention.out.weight"],
                               before["layers.0.attention.out.weight"]
                               + 0.7 * updates["layers.0.attention.to_out.0"])
    assert torch.equal(after["noise_refiner.0.attention.qkv.weight"],
                       before["noise_refiner.0.attention.qkv.weight"])
    loaded = ZImageTransformer2DModel.from_single_file(
        str(out), config=str(files["base"]), subfolder="transformer", local_files_only=True)
    reference = ZImageTransformer2DModel.from_pretrained(merged, subfolder="transformer",
                                                         local_files_only=True).state_dict()
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=key)
    # extract from two such files (q/k/v read from their rows): at the LoRA's rank 4 the
    # difference is reproduced, 0.7 x each update
    extracted = tmp_path / "from_files.safetensors"
    assert main(["extract", "--base", str(comfy), "--tuned", str(out), "--config-folder",
                 str(files["base"]), "--rank", "4", "-o", str(extracted)]) == 0
    got = _updates(extracted)
    assert got.keys() == updates.keys()
    for name, update in got.items():
        torch.testing.assert_close(update, 0.7 * updates[name], rtol=1e-4, atol=1e-6)
    # the folder base merged into a .safetensors: the same file, streamed (q/k/v fused)
    from_folder = tmp_path / "from_folder.safetensors"
    assert main(["merge", "--base", str(files["base"]), "--lora", f"{files['a']}:0.7",
                 "-o", str(from_folder)]) == 0
    written = load_file(str(from_folder))
    assert written.keys() == after.keys()
    for key, value in after.items():
        assert torch.equal(written[key], value), key


def test_merge_several_zimage_loras_is_the_weighted_sum(files, tmp_path):
    """A kohya and a peft file (ranks 4 and 2) merged into one diffusers file: its update at
    each layer is 0.5 · ΔA - 0.3 · ΔB, by hand."""
    out = tmp_path / "ab.safetensors"
    assert main(["merge-loras", "--base", str(files["base"]), "--lora", f"{files['a']}:0.5",
                 "--lora", f"{files['b']}:-0.3", "--layout", "diffusers", "-o", str(out)]) == 0
    a, b, ab = _updates(files["a"]), _peft_updates(files["b"]), _peft_updates(out)
    assert ab.keys() == a.keys() == b.keys()
    for name in ab:
        torch.testing.assert_close(ab[name], 0.5 * a[name] - 0.3 * b[name],
                                   rtol=1e-5, atol=1e-6)


def test_extract_from_two_zimage_bases_keeps_what_svd_says(files, merged, tmp_path):
    """The difference merged - base is rank 4 per layer: rank 2 keeps the top two squared
    singular values' share (torch.linalg.svdvals of the difference computed here), and the
    extracted update is the difference's best rank-2 approximation."""
    out = tmp_path / "extracted.safetensors"
    assert main(["extract", "--base", str(files["base"]), "--tuned", str(merged), "--rank", "2",
                 "-o", str(out)]) == 0
    base = load_file(str(files["base"] / TRANSFORMER_FILE))
    tuned = load_file(str(merged / TRANSFORMER_FILE))
    got = _updates(out)
    assert got.keys() == _updates(files["a"]).keys()  # exactly the layers the LoRA changed
    for name, update in got.items():
        diff = (tuned[name + ".weight"] - base[name + ".weight"]).double()
        u, s, vh = torch.linalg.svd(diff)
        best = (u[:, :2] * s[:2]) @ vh[:2]
        torch.testing.assert_close(update.double(), best, rtol=1e-4, atol=1e-6)


def test_resize_zimage_lora_reports_the_svd_error(files, tmp_path):
    from modules.lora_tools.operations import run_tool
    out = tmp_path / "small.safetensors"
    report = run_tool("resize", base=files["base"], loras=[(files["a"], 1.0)], rank=1,
                      output=out)
    updates = _updates(files["a"])
    for name, update in updates.items():
        s = torch.linalg.svdvals(update.double())
        expected = float((s[1:] ** 2).sum().sqrt() / (s ** 2).sum().sqrt())
        assert report.per_layer[f"transformer.{name}"] == pytest.approx(expected, rel=1e-6)
    assert {t.shape[0] for k, t in load_file(str(out)).items() if "lora_down" in k} == {1}


def test_convert_between_comfyui_and_peft_namings_keeps_every_update(files, tmp_path):
    there, back = tmp_path / "peft.safetensors", tmp_path / "kohya.safetensors"
    assert main(["convert", "--base", str(files["base"]), "--lora", str(files["b"]),
                 "--layout", "kohya", "-o", str(there)]) == 0
    assert all(k.startswith("diffusion_model.layers.") for k in load_file(str(there)))
    assert main(["convert", "--base", str(files["base"]), "--lora", str(there),
                 "--layout", "diffusers", "-o", str(back)]) == 0
    original, kohya, peft = _peft_updates(files["b"]), _updates(there), _peft_updates(back)
    assert original.keys() == kohya.keys() == peft.keys()
    for name in original:
        torch.testing.assert_close(kohya[name], original[name], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(peft[name], original[name], rtol=1e-6, atol=1e-7)
    # diffusers' own Z-Image loader reads the ComfyUI-layout file the tool wrote as it reads
    # the trainer's peft file: the same transformer output
    from diffusers import ZImagePipeline
    outputs = []
    for file in (files["b"], there):
        pipe = ZImagePipeline.from_pretrained(files["base"], local_files_only=True)
        pipe.load_lora_weights(str(file.parent), weight_name=file.name)
        outputs.append(_forward(pipe.transformer))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)


def test_lokr_is_refused_where_undefined_and_merged_where_it_is(files, tmp_path):
    """A LoKr layer (kron(w1, w2)): merge-loras refuses it naming why; merging into the base
    adds kron(w1, w2) (both factors full: no rank, scale 1), computed here."""
    w1, w2 = torch.randn(4, 4) * 0.1, torch.randn(8, 8) * 0.1
    name = "diffusion_model.layers.0.attention.to_q"
    lokr = tmp_path / "lokr.safetensors"
    save_file({f"{name}.lokr_w1": w1, f"{name}.lokr_w2": w2,
               f"{name}.alpha": torch.tensor(1.0)}, str(lokr))
    assert main(["merge-loras", "--base", str(files["base"]), "--lora", str(lokr),
                 "-o", str(tmp_path / "x.safetensors")]) == 2
    assert not (tmp_path / "x.safetensors").exists()
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(files["base"]), "--lora", str(lokr), "-o", str(out)]) == 0
    key = "layers.0.attention.to_q.weight"
    torch.testing.assert_close(load_file(str(out / TRANSFORMER_FILE))[key],
                               load_file(str(files["base"] / TRANSFORMER_FILE))[key]
                               + torch.kron(w1, w2))


def test_mixing_families_is_refused_naming_both(files, tempera_cache, tmp_path, capsys):
    """A Z-Image LoRA into an SD 1.5 base, and an SD LoRA into a Z-Image base: each refused
    with exit 2, the message naming both families, nothing written."""
    sd = ensure_builtin_model(MODEL_TYPES[ModelType.SD15].builtin, tempera_cache)
    out = tmp_path / "out"
    assert main(["merge", "--base", str(sd), "--lora", str(files["a"]), "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert "Z-Image LoRA" in error and "Stable Diffusion 1.x" in error
    sd_lora = tmp_path / "sd_lora.safetensors"
    name = "lora_unet_down_blocks_0_attentions_0_proj_in"
    save_file({f"{name}.lora_down.weight": torch.zeros(2, 8),
               f"{name}.lora_up.weight": torch.zeros(8, 2)}, str(sd_lora))
    assert main(["convert", "--base", str(files["base"]), "--lora", str(sd_lora),
                 "--layout", "diffusers", "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert "Stable Diffusion" in error and "Z-Image (ZIMAGE)" in error
    assert main(["resize", "--base", str(files["base"]), "--model-type", "sdxl",
                 "--lora", str(files["a"]), "--rank", "1", "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert "is Z-Image (ZIMAGE), not Stable Diffusion XL (SDXL)" in error
    assert not out.exists()


def test_full_size_names_without_a_base_and_a_file_that_does_not_fit_the_configs(
        files, tmp_path, capsys):
    """`--model-type zimage` names layers from the shipped full-size configs (a rank-1 LoRA
    of the real 3840-wide to_q is converted; its update checked by hand); the same LoRA fits
    those configs but not the tiny ComfyUI file merged without --config-folder: refused,
    naming the tensor and --config-folder, nothing written."""
    from diffusers import ZImageTransformer2DModel

    from modules.models.zimage_files import save_transformer_file
    name = "diffusion_model.layers.29.attention.to_q"
    generator = torch.Generator().manual_seed(3)
    down, up = torch.randn(1, 3840, generator=generator), torch.randn(3840, 1, generator=generator)
    big = tmp_path / "big.safetensors"
    save_file({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
               f"{name}.alpha": torch.tensor(0.5)}, str(big))
    peft = tmp_path / "big_peft.safetensors"
    assert main(["convert", "--model-type", "zimage", "--lora", str(big), "--layout",
                 "diffusers", "-o", str(peft)]) == 0
    converted = _peft_updates(peft)
    assert list(converted) == ["layers.29.attention.to_q"]
    torch.testing.assert_close(converted["layers.29.attention.to_q"], 0.5 * up @ down)
    plain = ZImageTransformer2DModel.from_pretrained(files["base"], subfolder="transformer",
                                                     local_files_only=True)
    comfy = save_transformer_file(plain, tmp_path / "tiny.safetensors")
    small = tmp_path / "small.safetensors"
    name = "diffusion_model.layers.0.attention.to_q"
    save_file({f"{name}.lora_down.weight": torch.zeros(1, 3840),
               f"{name}.lora_up.weight": torch.zeros(3840, 1)}, str(small))
    out = tmp_path / "merged.safetensors"
    assert main(["merge", "--base", str(comfy), "--lora", str(small), "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert "layers.0.attention.qkv.weight is (96, 32)" in error and "--config-folder" in error
    assert not out.exists()


def test_comfyui_applies_the_merged_lora_the_tools_write(files, tmp_path, comfyui, caplog):
    """ComfyUI's own LoRA loading (comfy.lora, on its fused-attention Z-Image model; skipped
    without `pytest --comfyui=PATH`) maps every tensor of a merge-loras output in the ComfyUI
    layout and applies 0.5 ΔA - 0.3 ΔB, computed here from the inputs."""
    from diffusers import ZImageTransformer2DModel

    from tests.models.test_zimage import _comfyui_applied
    out = tmp_path / "ab_comfy.safetensors"
    assert main(["merge-loras", "--base", str(files["base"]), "--lora", f"{files['a']}:0.5",
                 "--lora", f"{files['b']}:-0.3", "--layout", "kohya", "-o", str(out)]) == 0
    transformer = ZImageTransformer2DModel.from_pretrained(files["base"], subfolder="transformer",
                                                           local_files_only=True)
    applied = _comfyui_applied(comfyui, transformer, load_file(str(out)), caplog)
    a, b = _updates(files["a"]), _peft_updates(files["b"])
    assert applied.keys() == a.keys()
    for name, update in applied.items():
        torch.testing.assert_close(update, 0.5 * a[name] - 0.3 * b[name], rtol=1e-5, atol=1e-6)
