"""`tempera-lora`'s five tools on the tiny models, each result checked against a computation
made here (the update up @ down · alpha / rank from the file's own tensors, peft's own merge,
diffusers' load_lora_weights + fuse_lora, torch's singular values), never against the tool."""
from __future__ import annotations

import re
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modules.cli.lora import FLAGS, main
from modules.config import Config, apply_overrides
from modules.config.schema import ModelType
from modules.lora_tools.errors import LoraToolError
from modules.model_types import MODEL_TYPES
from modules.models.tiny import ensure_builtin_model

UNET_FILE = "unet/diffusion_pytorch_model.safetensors"
TEXT_FILE = "text_encoder/model.safetensors"


@pytest.fixture(scope="module")
def trained(tempera_cache, tmp_path_factory):
    """A LoCon (rank 4, alpha 8; convolutions rank 2, alpha 1) with the text encoder, trained
    2 steps on the tiny SD 1.5, saved in both layouts: the module's one training run (about
    15 s of its setup on 2 CPU cores: the trainer's start and 2 steps), which every test reads."""
    from modules.train.trainer import train
    out = tmp_path_factory.mktemp("lora-run")
    config = apply_overrides(Config(), [
        f"general.cache_dir={tempera_cache}", f"output.dir={out}", "data.resolution=64",
        "training.max_steps=2", "training.batch_size=1", "training.learning_rate=1e-2",
        "sampling.prompts=[]", "logging.tensorboard=false", "training.adapter=LOCON",
        "training.lora_rank=4", "training.lora_alpha=8", "training.conv_rank=2",
        "training.conv_alpha=1", "components.text_encoder.train=true",
        "output.formats=diffusers,kohya"])
    train(config)
    base = ensure_builtin_model(MODEL_TYPES[ModelType.SD15].builtin, tempera_cache)
    return {"base": Path(base), "kohya": out / "final" / "lora_kohya.safetensors",
            "diffusers": out / "final" / "pytorch_lora_weights.safetensors"}


def add_random_lora(module, config, generator: torch.Generator) -> None:
    """`config`'s LoRA added to `module` with random factors (both non-zero: a real update)."""
    module.add_adapter(config)
    for key, param in module.named_parameters():
        if "lora_" in key:
            param.data = torch.randn(param.shape, generator=generator) * 0.1


def _kohya_updates(path: Path) -> dict[str, torch.Tensor]:
    """{kohya name: alpha / rank · up @ down (flattened)} read straight from the file."""
    tensors = load_file(str(path))
    names = {k.split(".")[0] for k in tensors}
    out = {}
    for name in names:
        down, up = tensors[f"{name}.lora_down.weight"], tensors[f"{name}.lora_up.weight"]
        out[name] = float(tensors[f"{name}.alpha"]) / down.shape[0] * (
            up.flatten(1) @ down.flatten(1))
    return out


def _sd_kohya_name(component: str, key: str) -> str:
    """SD 1.x's kohya name of a weight key (diffusers module names, dots to underscores)."""
    prefix = "lora_unet_" if component == "unet" else "lora_te_"
    return prefix + key.removesuffix(".weight").replace(".", "_")


@pytest.fixture(scope="module")
def merged(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("merged") / "model"
    assert main(["merge", "--base", str(trained["base"]), "--lora",
                 f"{trained['kohya']}:0.7", "-o", str(out)]) == 0
    return out


def test_merge_into_a_folder_is_the_base_plus_the_weighted_update(trained, merged):
    updates = _kohya_updates(trained["kohya"])
    changed = 0
    for component, file in (("unet", UNET_FILE), ("text_encoder", TEXT_FILE)):
        base, result = load_file(str(trained["base"] / file)), load_file(str(merged / file))
        assert result.keys() == base.keys()
        for key, weight in base.items():
            name = _sd_kohya_name(component, key)
            if key.endswith(".weight") and name in updates:
                expected = weight + 0.7 * updates[name].reshape(weight.shape)
                torch.testing.assert_close(result[key], expected, rtol=1e-5, atol=1e-6)
                changed += 1
            else:
                assert torch.equal(result[key], weight), key
    assert changed == len(updates) > 50  # LoCon: attention, projections, ResNet convolutions
    for config in ("unet/config.json", "model_index.json", "tokenizer/vocab.json"):
        assert (merged / config).read_bytes() == (trained["base"] / config).read_bytes()


def test_diffusers_fuse_lora_of_the_converted_file_gives_the_merged_folder(trained, merged,
                                                                          tmp_path):
    """convert (kohya -> diffusers) read by diffusers' own loader, fused at 0.7, equals the
    merged folder: both the conversion and the merge mean what diffusers means."""
    from diffusers import StableDiffusionPipeline
    converted = tmp_path / "peft.safetensors"
    assert main(["convert", "--base", str(trained["base"]), "--lora", str(trained["kohya"]),
                 "--layout", "diffusers", "-o", str(converted)]) == 0
    pipe = StableDiffusionPipeline.from_pretrained(trained["base"], safety_checker=None,
                                                   local_files_only=True)
    pipe.load_lora_weights(str(tmp_path), weight_name=converted.name)
    pipe.fuse_lora(components=["unet", "text_encoder"], lora_scale=0.7)
    pipe.unload_lora_weights()
    reference = StableDiffusionPipeline.from_pretrained(merged, safety_checker=None,
                                                        local_files_only=True)
    for name in ("unet", "text_encoder"):
        fused, ours = getattr(pipe, name).state_dict(), getattr(reference, name).state_dict()
        assert fused.keys() == ours.keys()
        for key in fused:
            torch.testing.assert_close(fused[key], ours[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_folder_merged_into_a_single_file_loads_in_diffusers_as_the_merged_folder(
        trained, merged, tmp_path):
    """The folder base written as one ldm file on the way (streamed): diffusers' own
    from_single_file reads it back as the merged folder, every component."""
    from diffusers import StableDiffusionPipeline

    from modules.models.single_file import load_single_file
    out = tmp_path / "merged.safetensors"
    assert main(["merge", "--base", str(trained["base"]), "--lora",
                 f"{trained['kohya']}:0.7", "-o", str(out)]) == 0
    loaded = load_single_file(out, ModelType.SD15, config_folder=trained["base"])
    reference = StableDiffusionPipeline.from_pretrained(merged, safety_checker=None,
                                                        local_files_only=True)
    for name in ("unet", "text_encoder", "vae"):
        ours, expected = loaded[name].state_dict(), getattr(reference, name).state_dict()
        assert ours.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(ours[key], expected[key], rtol=0, atol=0, msg=key)


def test_convert_round_trip_keeps_every_update(trained, tmp_path):
    there, back = tmp_path / "peft.safetensors", tmp_path / "kohya.safetensors"
    base = ["--base", str(trained["base"])]
    assert main(["convert", *base, "--lora", str(trained["kohya"]), "--layout", "diffusers",
                 "-o", str(there)]) == 0
    assert main(["convert", *base, "--lora", str(there), "--layout", "kohya",
                 "-o", str(back)]) == 0
    original, converted = _kohya_updates(trained["kohya"]), _kohya_updates(back)
    assert converted.keys() == original.keys()
    for name in original:
        torch.testing.assert_close(converted[name], original[name], rtol=1e-5, atol=1e-7)


def test_merging_several_loras_concatenates_ranks_exactly(trained, tmp_path):
    out = tmp_path / "sum.safetensors"
    assert main(["merge-loras", "--base", str(trained["base"]), "--lora",
                 f"{trained['kohya']}:0.5", "--lora", f"{trained['diffusers']}:0.25",
                 "-o", str(out)]) == 0
    original, result = _kohya_updates(trained["kohya"]), _kohya_updates(out)
    assert result.keys() == original.keys()
    for name in original:
        torch.testing.assert_close(result[name], 0.75 * original[name], rtol=1e-5, atol=1e-7)
    ranks = {t.shape[0] for k, t in load_file(str(out)).items() if k.endswith("lora_down.weight")}
    assert ranks == {8, 4}  # 4 + 4 (linear), 2 + 2 (convolutions)


def test_resize_gives_the_best_approximation_and_its_error_per_layer(trained, tmp_path):
    out = tmp_path / "r2.safetensors"
    from modules.cli.lora import parse_args, run
    report = run(parse_args(["resize", "--base", str(trained["base"]), "--lora",
                             str(trained["kohya"]), "--rank", "2", "-o", str(out)]))
    original, result = _kohya_updates(trained["kohya"]), _kohya_updates(out)
    assert len(report.per_layer) == len(original)
    for name, update in original.items():
        s = torch.linalg.svdvals(update.double())
        expected = float((s[2:] ** 2).sum().sqrt() / (s ** 2).sum().sqrt())
        actual = float((result[name].double() - update.double()).norm() / update.double().norm())
        assert actual == pytest.approx(expected, abs=1e-5)  # Eckart–Young: nothing better
        label = next(k for k in report.per_layer
                     if _sd_kohya_name(k.split(".")[0], k.split(".", 1)[1]) == name)
        assert report.per_layer[label] == pytest.approx(expected, abs=1e-5)
    assert any(v > 0.01 for v in report.per_layer.values())  # rank 4 -> 2 loses something


def _tuned_copy(base: Path, folder: Path, generator) -> dict[tuple[str, str], torch.Tensor]:
    """The base with a random full-rank change to two layers; returns the changes."""
    shutil.copytree(base, folder)
    changes = {}
    # out_proj: diffusers 0.42 tells a kohya file's text-encoder keys apart by `to_out_lora`,
    # and refuses one without it ("Could not automatically infer state dict type")
    for file, key in ((TEXT_FILE, "text_model.encoder.layers.0.self_attn.out_proj.weight"),
                      (UNET_FILE, "down_blocks.0.resnets.0.conv1.weight")):
        tensors = load_file(str(folder / file))
        change = torch.randn(tensors[key].shape, generator=generator) * 0.1
        tensors[key] = tensors[key] + change
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        changes[(file, key)] = change
    return changes


def test_extract_reproduces_the_difference_at_full_rank_and_reports_the_share_kept(
        trained, tmp_path):
    from modules.cli.lora import parse_args, run
    tuned = tmp_path / "tuned"
    changes = _tuned_copy(trained["base"], tuned, torch.Generator().manual_seed(0))
    args = ["extract", "--base", str(trained["base"]), "--tuned", str(tuned)]
    full = run(parse_args([*args, "--rank", "32", "--conv-rank", "32", "-o",
                           str(tmp_path / "full.safetensors")]))
    assert full.overall == pytest.approx(1.0, abs=1e-6)
    updates = _kohya_updates(tmp_path / "full.safetensors")
    assert len(updates) == 2
    for (file, key), change in changes.items():
        name = _sd_kohya_name(file.split("/")[0], key)
        torch.testing.assert_close(updates[name].reshape(change.shape), change, atol=1e-5,
                                   rtol=1e-4)
    # diffusers' own kohya loader, fused at 1, gives the tuned model's weights
    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained(trained["base"], safety_checker=None,
                                                   local_files_only=True)
    pipe.load_lora_weights(str(tmp_path), weight_name="full.safetensors")
    pipe.fuse_lora(components=["unet", "text_encoder"], lora_scale=1.0)
    pipe.unload_lora_weights()
    for (file, key), change in changes.items():
        module = getattr(pipe, file.split("/")[0])
        fused = module.state_dict()[key.removeprefix("text_model.")
                                    if key not in module.state_dict() else key]
        torch.testing.assert_close(fused, load_file(str(tuned / file))[key], atol=1e-5,
                                   rtol=1e-4)
    low = run(parse_args([*args, "--rank", "4", "--conv-rank", "4", "-o",
                          str(tmp_path / "low.safetensors")]))
    kept = total = 0.0
    for (file, key), change in changes.items():
        s2 = torch.linalg.svdvals(change.flatten(1).double()) ** 2
        label = f"{file.split('/')[0]}.{key.removesuffix('.weight')}"
        assert low.per_layer[label] == pytest.approx(float(s2[:4].sum() / s2.sum()), abs=1e-6)
        kept, total = kept + float(s2[:4].sum()), total + float(s2.sum())
    assert low.overall == pytest.approx(kept / total, abs=1e-6) and low.overall < 0.9
    # a rank the changed 32 x 32 layer cannot have: refused, naming the input (its flag on the
    # command line), nothing written
    with pytest.raises(LoraToolError) as refused:
        run(parse_args([*args, "--rank", "33", "-o", str(tmp_path / "x.safetensors")]))
    assert refused.value.fields[0] == "rank"
    assert re.search(r"--rank 33.*out_proj", refused.value.text(FLAGS))
    assert not (tmp_path / "x.safetensors").exists()


# --- SDXL: ldm names, a single file, OpenCLIP's fused q/k/v, streamed -----------------------
@pytest.fixture(scope="module")
def sdxl(tempera_cache, tmp_path_factory):
    """The tiny SDXL as one ldm file, a random kohya LoRA on its UNet and second (OpenCLIP)
    text encoder, and what peft's own merge makes of each adapted layer at weight 0.6."""
    from diffusers import StableDiffusionXLPipeline
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    from modules.models.families import family_files
    from modules.models.kohya import save_kohya_lora
    from modules.models.single_file import save_single_file
    folder = Path(ensure_builtin_model(MODEL_TYPES[ModelType.SDXL].builtin, tempera_cache))
    work = tmp_path_factory.mktemp("sdxl")
    pipe = StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True)
    parts = {"unet": pipe.unet, "vae": pipe.vae, "text_encoder": pipe.text_encoder,
             "text_encoder_2": pipe.text_encoder_2, "scheduler": pipe.scheduler}
    single = save_single_file(parts, work / "base.safetensors", family_files(ModelType.SDXL))
    generator = torch.Generator().manual_seed(1)
    modules = {"unet": pipe.unet, "text_encoder_2": pipe.text_encoder_2}
    targets = {"unet": ["to_q", "to_v", "proj_in", "conv1"],
               "text_encoder_2": ["q_proj", "k_proj", "v_proj", "fc1"]}
    for name, module in modules.items():
        add_random_lora(module, LoraConfig(r=4, lora_alpha=8, target_modules=targets[name]),
                        generator)
    lora = save_kohya_lora(modules, work / "xl.safetensors", 8.0, ModelType.SDXL)
    expected = {}
    for name, module in modules.items():
        for path, layer in module.named_modules():
            if isinstance(layer, LoraLayer):
                base = layer.get_base_layer().weight.detach().clone()
                layer.merge()
                expected[(name, path)] = base + 0.6 * (layer.get_base_layer().weight - base)
    return {"folder": folder, "single": single, "lora": lora, "expected": expected}


def test_merge_into_an_sdxl_single_file_streams_and_matches_peft(sdxl, tmp_path, monkeypatch):
    import safetensors

    real, alive, reads = safetensors.safe_open, [], []

    class OneAtATime:
        """safe_open that fails when a base tensor is read while an earlier one is alive."""
        def __init__(self, path, *args, **kwargs):
            self.path, self.inner = str(path), real(path, *args, **kwargs)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def get_tensor(self, key):
            tensor = self.inner.get_tensor(key)
            if self.path == str(sdxl["single"]):
                assert all(ref() is None for ref in alive), "two base tensors held at once"
                alive.append(weakref.ref(tensor))
                reads.append(key)
            return tensor

    monkeypatch.setattr(safetensors, "safe_open", OneAtATime)
    out = tmp_path / "merged.safetensors"
    assert main(["merge", "--base", str(sdxl["single"]), "--config-folder", str(sdxl["folder"]),
                 "--lora", f"{sdxl['lora']}:0.6", "-o", str(out)]) == 0
    monkeypatch.setattr(safetensors, "safe_open", real)
    # one read per changed tensor (q, k and v share OpenCLIP's in_proj_weight), none other
    assert len(reads) == len(set(reads)) == len(sdxl["expected"]) - 2 * 2  # 2 layers' q/k/v
    # read back with diffusers' own ldm converters (its pipeline loader cannot tell the tiny
    # SDXL's two equally wide encoders apart: tests/models/test_single_file.py)
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (convert_ldm_unet_checkpoint,
                                                     convert_open_clip_checkpoint)
    from transformers import CLIPTextModelWithProjection
    checkpoint = load_file(str(out))
    encoder = CLIPTextModelWithProjection.from_pretrained(sdxl["folder"] / "text_encoder_2")
    loaded = {"unet": convert_ldm_unet_checkpoint(
                  checkpoint, UNet2DConditionModel.load_config(sdxl["folder"] / "unet")),
              "text_encoder_2": {k.removeprefix("text_model."): v for k, v in
                                 convert_open_clip_checkpoint(
                                     encoder, checkpoint, "conditioner.embedders.1.model.").items()}}
    for (name, path), weight in sdxl["expected"].items():
        got = loaded[name][path.removeprefix("text_model.") + ".weight"]
        torch.testing.assert_close(got, weight, rtol=1e-5, atol=1e-6, msg=f"{name} {path}")
    # the SDXL folder merged into a single file (q/k/v fused on the way) is the same file
    from_folder = tmp_path / "from-folder.safetensors"
    assert main(["merge", "--base", str(sdxl["folder"]), "--lora", f"{sdxl['lora']}:0.6",
                 "-o", str(from_folder)]) == 0
    other = load_file(str(from_folder))
    assert other.keys() == checkpoint.keys()
    for key, value in checkpoint.items():
        torch.testing.assert_close(other[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_extract_from_two_sdxl_single_files_gives_back_the_merged_update(sdxl, tmp_path):
    """The base and the tool's merge at 0.6, both SDXL single files (OpenCLIP's fused q/k/v
    read by rows, its transposed text projection left out): full rank gives 0.6 x each layer's
    update, computed here from the LoRA's own tensors."""
    from modules.cli.lora import parse_args, run
    base = ["--base", str(sdxl["single"]), "--config-folder", str(sdxl["folder"])]
    merged, out = tmp_path / "merged.safetensors", tmp_path / "extracted.safetensors"
    assert main(["merge", *base, "--lora", f"{sdxl['lora']}:0.6", "-o", str(merged)]) == 0
    report = run(parse_args(["extract", *base, "--tuned", str(merged), "--rank", "8",
                             "--conv-rank", "8", "-o", str(out)]))
    assert report.overall == pytest.approx(1.0, abs=1e-6)
    original, extracted = _kohya_updates(sdxl["lora"]), _kohya_updates(out)
    assert extracted.keys() == original.keys()
    for name, update in original.items():
        torch.testing.assert_close(extracted[name], 0.6 * update, rtol=1e-4, atol=1e-5)


def test_sd2_merges_into_a_folder_and_a_single_file_as_peft_merges(tempera_cache, tmp_path):
    """SD 2: OpenCLIP text encoder (q/k/v fused in its single file) with the diffusers UNet
    names; both outputs give what peft's own merge gives, the single file read back by
    diffusers' from_single_file."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    from modules.models.kohya import save_kohya_lora
    from modules.models.single_file import load_single_file
    folder = Path(ensure_builtin_model(MODEL_TYPES[ModelType.SD2].builtin, tempera_cache))
    pipe = StableDiffusionPipeline.from_pretrained(folder, local_files_only=True)
    modules = {"unet": pipe.unet, "text_encoder": pipe.text_encoder}
    generator = torch.Generator().manual_seed(4)
    for name, module in modules.items():
        targets = ["to_k", "proj_in"] if name == "unet" else ["q_proj", "v_proj", "out_proj"]
        add_random_lora(module, LoraConfig(r=2, lora_alpha=3, target_modules=targets), generator)
    lora = save_kohya_lora(modules, tmp_path / "sd2.safetensors", 3.0, ModelType.SD2)
    expected = {}
    for name, module in modules.items():
        for path, layer in module.named_modules():
            if isinstance(layer, LoraLayer):
                layer.merge()
                expected[(name, path.removeprefix("text_model."))] = \
                    layer.get_base_layer().weight.detach().clone()
    for out in (tmp_path / "merged", tmp_path / "merged.safetensors"):
        assert main(["merge", "--base", str(folder), "--lora", str(lora), "-o", str(out)]) == 0
    loaded = load_single_file(tmp_path / "merged.safetensors", ModelType.SD2,
                              config_folder=folder)
    files = {"unet": load_file(str(tmp_path / "merged" / UNET_FILE)),
             "text_encoder": load_file(str(tmp_path / "merged" / TEXT_FILE))}
    for (name, path), weight in expected.items():
        stored = files[name].get(path + ".weight", files[name].get(f"text_model.{path}.weight"))
        torch.testing.assert_close(stored, weight, rtol=1e-5, atol=1e-6, msg=path)
        state = loaded[name].state_dict()
        got = state.get(path + ".weight", state.get(f"text_model.{path}.weight"))
        torch.testing.assert_close(got, weight, rtol=1e-5, atol=1e-6, msg=path)


# --- what is refused -------------------------------------------------------------------------
def _adapter_config(kind: str):
    from peft import LoHaConfig, LoKrConfig, LoraConfig
    targets = ["to_q", "to_k"]
    return {"loha": LoHaConfig(r=4, alpha=8, target_modules=targets),
            "lokr": LoKrConfig(r=2, alpha=8, target_modules=targets, decompose_both=True),
            "dora": LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=True)}[kind]


@pytest.fixture(scope="module", params=["loha", "lokr", "dora"])
def lycoris(request, trained, tmp_path_factory):
    """A random LoHa / LoKr / DoRA on the tiny SD 1.5 UNet's attention, its kohya file, and
    peft's own merge of each layer."""
    from diffusers import UNet2DConditionModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    from modules.models.kohya import save_kohya_lora
    unet = UNet2DConditionModel.from_pretrained(trained["base"] / "unet")
    unet.add_adapter(_adapter_config(request.param))
    generator = torch.Generator().manual_seed(2)
    for key, param in unet.named_parameters():
        if param.requires_grad:  # the adapter's tensors; DoRA's magnitudes kept positive
            noise = torch.randn(param.shape, generator=generator)
            param.data = param.data * (1 + 0.2 * noise) if "magnitude" in key else noise * 0.3
    path = save_kohya_lora({"unet": unet}, tmp_path_factory.mktemp(request.param)
                           / f"{request.param}.safetensors", None, ModelType.SD15)
    expected = {}
    for name, layer in unet.named_modules():
        if isinstance(layer, BaseTunerLayer):
            base = layer.get_base_layer().weight.detach().clone()
            layer.merge()
            expected[name + ".weight"] = base + 0.6 * (layer.get_base_layer().weight - base)
    return request.param, path, expected


def test_loha_lokr_and_dora_merge_into_the_base_as_peft_merges_them(trained, lycoris, tmp_path):
    _, path, expected = lycoris
    out = tmp_path / "merged"
    assert main(["merge", "--base", str(trained["base"]), "--lora", f"{path}:0.6", "-o",
                 str(out)]) == 0
    result = load_file(str(out / UNET_FILE))
    assert len(expected) == 16  # attn1 / attn2 q and k of four transformer blocks
    for key, weight in expected.items():
        torch.testing.assert_close(result[key], weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("command", [["merge-loras"], ["resize", "--rank", "2"],
                                     ["convert", "--layout", "diffusers"]])
def test_loha_lokr_and_dora_are_refused_where_their_maths_is_not_defined(
        trained, lycoris, tmp_path, capsys, command):
    kind, path, _ = lycoris
    out = tmp_path / "out.safetensors"
    assert main([command[0], "--base", str(trained["base"]), "--lora", str(path),
                 *command[1:], "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert str(path) in error and kind.upper() in error
    assert not out.exists()


def test_bad_input_names_the_file_or_argument_and_writes_nothing(trained, tempera_cache,
                                                                tmp_path, capsys):
    base, kohya = str(trained["base"]), str(trained["kohya"])
    out = tmp_path / "out"

    def refused(*args: str) -> str:
        assert main(list(args)) == 2
        assert not out.exists()
        return capsys.readouterr().err

    not_lora = str(trained["base"] / UNET_FILE)
    assert f"{not_lora}: not a LoRA" in refused("merge", "--base", base, "--lora", not_lora,
                                                "-o", str(out))
    assert "no such LoRA file" in refused("merge", "--base", base, "--lora",
                                          str(tmp_path / "missing.safetensors"), "-o", str(out))
    xl = str(ensure_builtin_model(MODEL_TYPES[ModelType.SDXL].builtin, tempera_cache))
    error = refused("merge", "--base", xl, "--lora", kohya, "-o", str(out))
    assert kohya in error and "not in the base" in error
    error = refused("resize", "--base", base, "--lora", kohya, "--rank", "5", "-o",
                    str(tmp_path / "r.safetensors"))
    assert "--rank 5" in error and kohya in error
    with pytest.raises(SystemExit) as exit_:
        main(["merge", "--base", base, "--lora", f"{kohya}:abc", "-o", str(out)])
    assert exit_.value.code == 2 and "'abc'" in capsys.readouterr().err
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["merge", "--base", base, "--lora", kohya, "-o", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
