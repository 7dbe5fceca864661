"""Z-Image's ComfyUI files: the three split files loaded as what they are (the tiny model's,
written in the layouts ComfyUI's downloads use), a wrong or missing one refused naming the file
and what was expected, Turbo named with what to do, and a fine-tuned transformer saved in the
layout ComfyUI detects (checked at full size on a weightless model with ComfyUI's own
detection when a checkout is given)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from modules.config import Config, apply_overrides
from modules.model_types import ModelType
from modules.models.families import family_of
from modules.models.single_file import vae_key_to_ldm
from modules.models.zimage_files import (distilled_problems, split_file_problems,
                                         to_original_names)


@pytest.fixture(scope="module")
def split_files(zimage_folder, tmp_path_factory):
    """The tiny model as ComfyUI's three files: the diffusion model in the original layout,
    Qwen3 under `model.`, the VAE in the ldm layout Flux's ae.safetensors uses."""
    bundle = family_of(ModelType.ZIMAGE).load_folder(zimage_folder, None, torch.float32)
    root = tmp_path_factory.mktemp("comfyui-files")
    paths = {"transformer": root / "z_image_bf16.safetensors",
             "text_encoder": root / "qwen_3_4b.safetensors", "vae": root / "ae.safetensors"}
    save_file({k: v.contiguous() for k, v in
               to_original_names(bundle.denoiser.state_dict()).items()}, paths["transformer"])
    save_file({f"model.{k}": v.contiguous() for k, v in
               bundle.text_encoders["text_encoder"].state_dict().items()},
              paths["text_encoder"])
    num_up = len(bundle.vae.config.up_block_types)
    vae = {}
    for key, value in bundle.vae.state_dict().items():
        name = vae_key_to_ldm(key, num_up)
        vae[name] = value[:, :, None, None] if ".mid.attn_1." in name and value.ndim == 2 \
            else value
    save_file({k: v.contiguous() for k, v in vae.items()}, paths["vae"])
    return bundle, paths


def _model(zimage_folder, paths, **changes):
    settings = {"model.type": "ZIMAGE", "model.path": paths["transformer"],
                "model.text_encoder_path": paths["text_encoder"],
                "model.vae_path": paths["vae"], "model.config_path": zimage_folder,
                **changes}
    return apply_overrides(Config(), [f"{k}={v}" for k, v in settings.items()]).model


def test_the_three_files_load_as_the_model_they_came_from(split_files, zimage_folder):
    bundle, paths = split_files
    loaded = family_of(ModelType.ZIMAGE).load_single_file(
        paths["transformer"], _model(zimage_folder, paths), torch.float32)
    for name, module in bundle.components().items():
        want, got = module.state_dict(), loaded.component(name).state_dict()
        assert want.keys() == got.keys(), name
        assert all(torch.equal(want[k], got[k]) for k in want), name
    assert loaded.tokenizers["tokenizer"].chat_template


def test_a_wrong_or_missing_part_is_named_with_what_was_expected(split_files, zimage_folder):
    _, paths = split_files
    assert split_file_problems(_model(zimage_folder, paths)) == []
    swapped = {p.path: p for p in split_file_problems(_model(
        zimage_folder, paths, **{"model.text_encoder_path": paths["vae"],
                                 "model.vae_path": paths["text_encoder"]}))}
    assert set(swapped) == {"model.text_encoder_path", "model.vae_path"}
    assert "ae.safetensors is a 16-channel VAE" in swapped["model.text_encoder_path"].message
    assert "it belongs in model.vae_path" in swapped["model.text_encoder_path"].message
    assert "16-channel VAE" in swapped["model.vae_path"].expected
    assert "qwen_3_4b.safetensors is a Qwen3 text encoder" in swapped["model.vae_path"].message
    missing = {p.path: p for p in split_file_problems(_model(zimage_folder, paths,
                                                             **{"model.vae_path": ""}))}
    assert list(missing) == ["model.vae_path"] and "models/vae" in missing["model.vae_path"].message
    lora = paths["transformer"].with_name("lora.safetensors")
    save_file({"diffusion_model.layers.0.attention.to_q.lora_down.weight": torch.zeros(2, 2)},
              lora)
    wrong = split_file_problems(_model(zimage_folder, paths, **{"model.path": lora}))
    assert [p.path for p in wrong] == ["model.path"] and "a LoRA" in wrong[0].message


def test_turbo_is_named_with_what_to_do(zimage_folder, split_files, tmp_path):
    turbo = tmp_path / "Z-Image-Turbo-copy"
    shutil.copytree(zimage_folder / "scheduler", turbo / "scheduler")
    config = json.loads((turbo / "scheduler" / "scheduler_config.json").read_text())
    (turbo / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config,
                                                                           "shift": 3.0}))
    for name, problems in [("folder", distilled_problems(
            Config().model.__class__(path=str(turbo / ".." / turbo.name)))),
            ("file", distilled_problems(Config().model.__class__(
                path="/models/z_image_turbo_bf16.safetensors")))]:
        assert len(problems) == 1, name
        assert "Z-Image-Turbo" in problems[0].message and "Z-Image Base" in problems[0].message
    plain = Config().model.__class__
    assert distilled_problems(plain(path=str(zimage_folder))) == []  # Base's shift 6
    assert distilled_problems(plain(path="/m/z_image_de_turbo_v1_bf16.safetensors")) == []
    assert distilled_problems(plain(path="/m/z_image_turbo.safetensors",
                                    train_distilled=True)) == []


def test_a_fine_tuned_transformer_is_saved_in_the_layout_diffusers_reads_back(
        split_files, zimage_folder, tmp_path):
    from diffusers import ZImageTransformer2DModel

    from modules.models.zimage_files import save_transformer_file
    bundle, _ = split_files
    path = save_transformer_file(bundle.denoiser, tmp_path / "model.safetensors")
    back = ZImageTransformer2DModel.from_single_file(str(path), config=str(zimage_folder),
                                                     subfolder="transformer",
                                                     local_files_only=True)
    want, got = bundle.denoiser.state_dict(), back.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_comfyui_detects_the_saved_layout_as_z_image_at_full_size(comfyui):
    """ComfyUI's own model detection on the saved layout of a weightless full-size Z-Image
    (the shipped configs): it finds Z-Image's architecture, as it does for its downloads."""
    from diffusers import ZImageTransformer2DModel

    from modules.models.single_file import CONFIGS_DIR
    config = ZImageTransformer2DModel.load_config(CONFIGS_DIR / "zimage" / "transformer")
    with torch.device("meta"):
        transformer = ZImageTransformer2DModel.from_config(config)
    saved = to_original_names(transformer.state_dict())
    detected = comfyui.model_detection.detect_unet_config(saved, "")
    assert detected["image_model"] == "lumina2" and detected.get("z_image_modulation")
    assert detected["n_layers"] == 30 and detected["dim"] == 3840
    found = comfyui.model_detection.model_config_from_unet(saved, "")
    assert type(found).__name__ == "ZImage"


def test_swapped_files_are_refused_before_anything_is_written(split_files, zimage_folder,
                                                              tmp_path):
    from modules.train.setup.inputs import check_inputs
    _, paths = split_files
    config = apply_overrides(Config(), [
        "model.type=ZIMAGE", f"model.path={paths['transformer']}",
        f"model.text_encoder_path={paths['vae']}", f"model.vae_path={paths['vae']}",
        f"model.tokenizer_path={zimage_folder}", f"output.dir={tmp_path / 'out'}"])
    problems = [p for p in check_inputs(config) if p.path.startswith("model.")]
    assert [p.path for p in problems] == ["model.text_encoder_path"]
    assert not (tmp_path / "out").exists()


def test_a_full_fine_tune_saves_a_diffusers_folder_and_comfyuis_file(tiny_config, tmp_path,
                                                                     zimage_folder):
    """2 steps of FINE_TUNE: final/ holds a ZImagePipeline folder and model.safetensors, the
    same transformer in ComfyUI's diffusion-model layout."""
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    from modules.train.trainer import train
    result = train(tiny_config("model.type=ZIMAGE", "model.path=builtin:tiny-zimage",
                               "training.method=FINE_TUNE", "training.max_steps=2",
                               "sampling.sampler=EULER",
                               'output.formats=["DIFFUSERS", "SINGLE_FILE"]'))
    final = result.output_dir / "final"
    pipe = ZImagePipeline.from_pretrained(final, local_files_only=True)
    single = ZImageTransformer2DModel.from_single_file(
        str(final / "model.safetensors"), config=str(zimage_folder), subfolder="transformer",
        local_files_only=True)
    want, got = pipe.transformer.state_dict(), single.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    base = ZImageTransformer2DModel.from_pretrained(zimage_folder, subfolder="transformer")
    assert not torch.equal(base.state_dict()["layers.0.attention.to_q.weight"],
                           want["layers.0.attention.to_q.weight"])  # it trained
    assert pipe.text_encoder.state_dict().keys() == ZImagePipeline.from_pretrained(
        zimage_folder, local_files_only=True).text_encoder.state_dict().keys()
