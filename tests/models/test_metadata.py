"""modelspec and kohya ss_* metadata on saved files."""
from __future__ import annotations

import datetime as dt
import json

import pytest
from safetensors import safe_open

from modules.config import apply_overrides, Config
from modules.config.loader import to_dict
from modules.config.schema import ModelType, PredictionType
from modules.models.metadata import training_metadata
from modules.models.families import family_files

NOW = dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def _config_dict(*overrides):
    return to_dict(apply_overrides(Config(), ["training.lora_rank=8", "training.lora_alpha=4",
                                              "data.resolution=768", "training.max_steps=100",
                                              "output.dir=/runs/my-style", *overrides]))


@pytest.mark.parametrize("model_type,prediction,arch", [
    (ModelType.SD15, None, "stable-diffusion-v1/lora"),
    (ModelType.SD2, None, "stable-diffusion-v2-768-v/lora"),
    (ModelType.SD2, "epsilon", "stable-diffusion-v2-512/lora"),
    (ModelType.SDXL, None, "stable-diffusion-xl-v1-base/lora"),
])
def test_lora_metadata_names_the_architecture_and_training(model_type, prediction, arch):
    meta = training_metadata(_config_dict(), model_type, "LORA", "lora",
                             prediction_type=prediction, now=NOW)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    assert meta["modelspec.sai_model_spec"] == "1.0.0"
    assert meta["modelspec.architecture"] == arch
    assert meta["modelspec.title"] == "my-style"
    assert meta["modelspec.resolution"] == "768x768"
    assert meta["modelspec.date"] == "2025-01-02T03:04:05+00:00"
    assert meta["ss_network_module"] == "networks.lora"
    assert meta["ss_network_dim"] == "8" and meta["ss_network_alpha"] == "4.0"
    assert meta["ss_max_train_steps"] == "100"
    assert meta["ss_resolution"] == "(768, 768)"
    assert meta["ss_v2"] == str(model_type == ModelType.SD2)
    assert json.loads(meta["tempera.config"])["training"]["lora_rank"] == 8


def test_checkpoint_metadata_has_no_network_keys():
    meta = training_metadata(_config_dict(), ModelType.SD15, "FINE_TUNE", "checkpoint",
                             layout="single_file", now=NOW)
    assert meta["modelspec.architecture"] == "stable-diffusion-v1"
    assert not any(k.startswith("ss_network") for k in meta)
    with pytest.raises(ValueError, match="kind"):
        training_metadata(_config_dict(), ModelType.SD15, "LORA", "weights")


def test_saved_kohya_and_single_file_carry_the_metadata(tempera_cache, tmp_path):
    from peft import LoraConfig

    from modules.models.kohya import save_kohya_lora
    from modules.models.sd_folder import load_model
    from modules.models.single_file import save_single_file
    from modules.models.tiny import ensure_builtin_model

    folder = ensure_builtin_model("builtin:tiny-sd15", tempera_cache)
    bundle = load_model(folder, ModelType.SD15, PredictionType.AUTO)
    config = _config_dict()
    full = save_single_file({"unet": bundle.denoiser, "vae": bundle.vae, **bundle.text_encoders},
                            tmp_path / "full.safetensors", family_files(ModelType.SD15),
                            training_metadata(config, ModelType.SD15, "FINE_TUNE", "checkpoint",
                                              layout="single_file"))
    bundle.denoiser.add_adapter(LoraConfig(r=8, lora_alpha=4, target_modules=["to_q"]))
    lora = save_kohya_lora({"unet": bundle.denoiser}, tmp_path / "lora.safetensors", 4.0,
                           ModelType.SD15,
                           training_metadata(config, ModelType.SD15, "LORA", "lora"))
    lora_meta = safe_open(str(lora), "pt").metadata()
    assert lora_meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert lora_meta["ss_network_dim"] == "8" and lora_meta["ss_base_model_version"] == "sd_v1"
    full_meta = safe_open(str(full), "pt").metadata()
    assert full_meta["modelspec.architecture"] == "stable-diffusion-v1"
    assert full_meta["modelspec.implementation"].startswith("https://github.com/Stability-AI")


def test_a_run_over_several_resolutions_names_the_largest():
    meta = training_metadata(_config_dict("data.resolutions=512,768",
                                          'data.datasets=[{"path": "a", "resolutions": [1024]}]'),
                             ModelType.SD15, "LORA", "lora", now=NOW)
    assert meta["modelspec.resolution"] == "1024x1024" and meta["ss_resolution"] == "(1024, 1024)"


def test_a_flow_matching_family_names_its_own_implementation_and_no_ddpm_prediction_type():
    """Z-Image trains on flow matching: modelspec's prediction types (epsilon, v) are DDPM's,
    so its files carry none, and their implementation is Z-Image's, not SD's (the family
    record's FileConventions say both)."""
    kohya = training_metadata(_config_dict(), ModelType.ZIMAGE, "LORA", "lora", now=NOW)
    assert kohya["modelspec.architecture"] == "z-image/lora"
    assert kohya["modelspec.implementation"] == "https://github.com/Tongyi-MAI/Z-Image"
    assert "modelspec.prediction_type" not in kohya
    peft = training_metadata(_config_dict(), ModelType.ZIMAGE, "LORA", "lora",
                             layout="diffusers", now=NOW)
    assert peft["modelspec.implementation"] == "diffusers"
    assert "modelspec.prediction_type" not in peft
    sd = training_metadata(_config_dict(), ModelType.SD15, "LORA", "lora", now=NOW)
    assert sd["modelspec.prediction_type"] == "epsilon"
    assert sd["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
