"""Single-file checkpoints: detection, the pickle guard, and the ldm layout round trip."""
from __future__ import annotations

import torch
import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from modules.config.schema import ModelType, PredictionType
from modules.models.sd_folder import load_model
from modules.models.single_file import (
    SingleFileError, config_folder_for, detect_model_type, load_single_file, save_single_file,
    to_ldm_state_dict)
from modules.models.tiny import ensure_builtin_model
from modules.model_types import MODEL_TYPES
from modules.models.families import family_files


def _tiny(model_type, cache):
    folder = ensure_builtin_model(MODEL_TYPES[model_type].builtin, cache)
    bundle = load_model(folder, model_type, PredictionType.AUTO)
    components = {"unet": bundle.denoiser, "vae": bundle.vae, **bundle.text_encoders,
                  "scheduler": bundle.noise_scheduler}
    return folder, components


def _assert_same_weights(original, loaded):
    a, b = original.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    different = [k for k in a if b[k].is_meta or not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.mark.parametrize("model_type", [ModelType.SD15, ModelType.SD2])
def test_tiny_model_round_trips_through_diffusers_single_file_loader(model_type, tempera_cache,
                                                                    tmp_path):
    folder, components = _tiny(model_type, tempera_cache)
    path = save_single_file(components, tmp_path / "model.safetensors", family_files(model_type),
                            {"modelspec.title": "t"})
    assert detect_model_type(path) == model_type
    assert safe_open(str(path), "pt").metadata()["modelspec.title"] == "t"
    loaded = load_single_file(path, model_type, config_folder=folder)
    for name in ("unet", "vae", *MODEL_TYPES[model_type].text_encoders):
        _assert_same_weights(components[name], loaded[name])
    assert not list(tmp_path.glob(".*.tmp")), "the atomic write left a temporary file"


def test_sdxl_layout_is_what_diffusers_converters_read(tempera_cache, tmp_path):
    # The tiny SDXL's two encoders are equally wide, which diffusers' pipeline loader cannot
    # tell apart (real SDXL's are 768 and 1280 wide), so its converters are called directly.
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint, convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint)
    from safetensors.torch import load_file

    _, components = _tiny(ModelType.SDXL, tempera_cache)
    path = save_single_file(components, tmp_path / "xl.safetensors", family_files(ModelType.SDXL))
    assert detect_model_type(path) == ModelType.SDXL
    ckpt = load_file(path)
    unet, vae = components["unet"], components["vae"]
    assert _same(convert_ldm_unet_checkpoint(ckpt, unet.config), unet.state_dict())
    assert _same(convert_ldm_vae_checkpoint(ckpt, vae.config), vae.state_dict())
    te1 = {k.removeprefix("text_model."): v for k, v in convert_ldm_clip_checkpoint(ckpt).items()}
    assert _same(te1, components["text_encoder"].state_dict())
    te2 = components["text_encoder_2"]
    assert _same(convert_open_clip_checkpoint(te2, ckpt, "conditioner.embedders.1.model."),
                 te2.state_dict())


def _same(converted, expected):
    assert converted.keys() == expected.keys(), set(converted) ^ set(expected)
    return all(torch.equal(converted[k], v) for k, v in expected.items())


@pytest.mark.parametrize("model_type,kind", [(ModelType.SD15, "v1"), (ModelType.SD2, "v2"),
                                             (ModelType.SDXL, "xl_base")])
def test_shipped_configs_give_the_real_architectures_ldm_names(model_type, kind):
    """Real-size models on the meta device: diffusers' own inference names our layout right."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import (
        convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint, infer_diffusers_model_type)
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    folder = config_folder_for(family_files(model_type))
    classes = {"text_encoder": CLIPTextModel, "text_encoder_2": CLIPTextModelWithProjection}
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(folder / "unet"))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(folder / "vae"))
        encoders = {n: classes[n](CLIPTextConfig.from_pretrained(folder / n))
                    for n in MODEL_TYPES[model_type].text_encoders}
    ldm = to_ldm_state_dict({"unet": unet, "vae": vae, **encoders}, family_files(model_type))
    assert infer_diffusers_model_type(ldm) == kind
    for converted, module in ((convert_ldm_unet_checkpoint(ldm, unet.config), unet),
                              (convert_ldm_vae_checkpoint(ldm, vae.config), vae)):
        expected = module.state_dict()
        assert converted.keys() == expected.keys()
        assert all(converted[k].shape == v.shape for k, v in expected.items())


def test_detect_rejects_files_that_are_not_sd_checkpoints(tmp_path):
    lora = tmp_path / "lora.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(1)}, str(lora))
    with pytest.raises(SingleFileError, match="looks like a LoRA"):
        detect_model_type(lora)
    unet_only = tmp_path / "unet.safetensors"
    save_file({"model.diffusion_model.out.2.weight": torch.zeros(1)}, str(unet_only))
    with pytest.raises(SingleFileError, match="no text encoder"):
        detect_model_type(unet_only)


def test_detect_reports_a_type_mismatch(tmp_path):
    path = tmp_path / "sd2.safetensors"
    save_file({"model.diffusion_model.out.2.weight": torch.zeros(1),
               "cond_stage_model.model.token_embedding.weight": torch.zeros(1)}, str(path))
    assert detect_model_type(path) == ModelType.SD2
    with pytest.raises(SingleFileError, match="model.type=SD2"):
        detect_model_type(path, expected=ModelType.SDXL)


def test_pickles_are_refused_by_default_and_loaded_weights_only_on_opt_in(tempera_cache,
                                                                         tmp_path):
    folder, components = _tiny(ModelType.SD15, tempera_cache)
    state = {"state_dict": to_ldm_state_dict(components, family_files(ModelType.SD15))}
    ckpt = tmp_path / "model.ckpt"
    torch.save(state, ckpt)
    with pytest.raises(SingleFileError, match="arbitrary code"):
        detect_model_type(ckpt)
    with pytest.raises(SingleFileError, match="arbitrary code"):
        load_single_file(ckpt, ModelType.SD15, config_folder=folder)
    assert detect_model_type(ckpt, allow_pickle=True) == ModelType.SD15
    loaded = load_single_file(ckpt, ModelType.SD15, allow_pickle=True, config_folder=folder)
    _assert_same_weights(components["unet"], loaded["unet"])


def test_a_pickle_holding_code_is_refused_even_on_opt_in(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("this ran",))
    evil = tmp_path / "evil.ckpt"
    torch.save({"model.diffusion_model.x": Payload()}, evil)
    with pytest.raises(Exception, match="[Ww]eights only|weights_only|Unsupported"):
        detect_model_type(evil, allow_pickle=True)


def test_shipped_config_without_a_tokenizer_says_where_to_put_one(tempera_cache, tmp_path):
    _, components = _tiny(ModelType.SD15, tempera_cache)
    path = save_single_file(components, tmp_path / "model.safetensors", family_files(ModelType.SD15))
    with pytest.raises(SingleFileError, match="tokenizer"):
        load_single_file(path, ModelType.SD15,
                         config_folder=config_folder_for(family_files(ModelType.SD15)))


def test_adapted_components_are_refused(tempera_cache, tmp_path):
    from peft import LoraConfig
    _, components = _tiny(ModelType.SD15, tempera_cache)
    components["unet"].add_adapter(LoraConfig(r=2, target_modules=["to_q"]))
    with pytest.raises(SingleFileError, match="LoRA adapters"):
        save_single_file(components, tmp_path / "model.safetensors", family_files(ModelType.SD15))
    assert not (tmp_path / "model.safetensors").exists()


def test_tokenizer_is_found_next_to_the_checkpoint_or_in_a_named_folder(tempera_cache, tmp_path):
    import shutil

    from modules.models.single_file import find_tokenizer_folder

    folder, _ = _tiny(ModelType.SDXL, tempera_cache)
    ckpt = tmp_path / "ckpt" / "xl.safetensors"
    ckpt.parent.mkdir()
    assert find_tokenizer_folder(ckpt, ModelType.SDXL, folder) == folder
    shutil.copytree(folder / "tokenizer", ckpt.parent / "tokenizer")
    with pytest.raises(SingleFileError, match="tokenizer_2/"):
        find_tokenizer_folder(ckpt, ModelType.SDXL)
    shutil.copytree(folder / "tokenizer_2", ckpt.parent / "tokenizer_2")
    assert find_tokenizer_folder(ckpt, ModelType.SDXL) == ckpt.parent


def test_bundle_from_a_single_file_matches_the_folder_bundle(tempera_cache, tmp_path):
    from diffusers import DDPMScheduler

    from modules.models.single_file import is_single_file, load_single_file_bundle

    folder, components = _tiny(ModelType.SD2, tempera_cache)
    path = save_single_file(components, tmp_path / "sd2.safetensors", family_files(ModelType.SD2))
    assert is_single_file(path) and not is_single_file(folder)
    bundle = load_single_file_bundle(path, ModelType.SD2, PredictionType.EPSILON,
                                     config_folder=folder)
    assert isinstance(bundle.noise_scheduler, DDPMScheduler)
    assert bundle.prediction_type == "epsilon"  # the explicit setting beats the config's v
    _assert_same_weights(components["text_encoder"], bundle.text_encoders["text_encoder"])
    assert set(bundle.tokenizers) == {"tokenizer"}
