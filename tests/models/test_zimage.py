"""Z-Image, the first transformer family, on the tiny random-weight model (built once per
session into the shared cache): the folder it builds is what diffusers' ZImagePipeline loads,
the family encodes captions and calls the transformer exactly as that pipeline does, and one
shared LoRA run (3 steps at 64 px) trains the main blocks with flow matching and saves a file
ZImagePipeline.load_lora_weights applies as trained."""
from __future__ import annotations

import math

import pytest
import torch

from modules.model_types import MODEL_TYPES, ModelType
from modules.models.families import family_of
from modules.models.tiny import ensure_builtin_model
from tests.train.test_resume import run_json

CAPTIONS = ["a red circle", "", "a small blue square on a large yellow triangle, seen from "
            "far above on a cloudy day with long shadows"]


@pytest.fixture(scope="session")
def zimage_folder(tempera_cache):
    return ensure_builtin_model(MODEL_TYPES[ModelType.ZIMAGE].builtin, tempera_cache)


@pytest.fixture(scope="module")
def pipeline(zimage_folder):
    from diffusers import ZImagePipeline
    pipe = ZImagePipeline.from_pretrained(zimage_folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def lora_run(zimage_folder, tempera_cache, tmp_path_factory):
    """One LoRA run every assertion on a run's results reads (3 steps, 64 px)."""
    from modules.config import Config, apply_overrides
    from modules.train.trainer import train
    out = tmp_path_factory.mktemp("zimage-lora") / "out"
    config = apply_overrides(Config(), [
        f"general.cache_dir={tempera_cache}", f"output.dir={out}", "data.resolution=64",
        "model.type=ZIMAGE", "model.path=builtin:tiny-zimage", "training.max_steps=3",
        "training.batch_size=2", "training.learning_rate=1e-2", "training.lora_rank=4",
        "training.lora_alpha=8", "logging.tensorboard=false",
        # flow matching's options, and a sample at the end with CFG and a negative prompt
        "loss.timestep_sampling=LOGIT_NORMAL", "loss.dynamic_shift=true",
        'sampling.prompts=["a red circle --n a blue square"]', "sampling.sampler=EULER",
        "sampling.steps=2", "sampling.guidance_scale=4"])
    return train(config)


def test_the_tiny_model_is_a_zimage_pipeline_shaped_like_the_real_one(pipeline):
    from transformers import Qwen3Model
    assert type(pipeline.transformer).__name__ == "ZImageTransformer2DModel"
    assert isinstance(pipeline.text_encoder, Qwen3Model)
    vae = pipeline.vae.config
    assert vae.latent_channels == 16 and vae.shift_factor and not vae.use_quant_conv
    assert pipeline.transformer.config.cap_feat_dim == pipeline.text_encoder.config.hidden_size
    prompt = pipeline.tokenizer.apply_chat_template(
        [{"role": "user", "content": "a cat"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    assert family_of(ModelType.ZIMAGE).repeated_blocks == tuple(
        type(pipeline.transformer)._repeated_blocks)  # what diffusers declares repeated


def test_captions_are_encoded_as_zimage_pipeline_encodes_them(pipeline, zimage_folder):
    family = family_of(ModelType.ZIMAGE)
    bundle = family.load_folder(zimage_folder, None, torch.float32)
    ours = family.encode_text(bundle, CAPTIONS, torch.device("cpu"), None)
    with torch.no_grad():
        reference, _ = pipeline.encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False)
    assert [int(n) for n in ours.lengths] == [len(r) for r in reference]
    for i, expected in enumerate(reference):
        # padded to a multiple of 32 here, to 512 there: a causal encoder's real tokens agree
        torch.testing.assert_close(ours.hidden[i, :len(expected)], expected,
                                   rtol=1e-5, atol=1e-5)
        assert not ours.hidden[i, len(expected):].any()  # zero past the caption
    assert ours.hidden.shape[1] % 32 == 0 and ours.hidden.shape[1] < 512


def test_the_family_calls_the_transformer_as_zimage_pipeline_does(pipeline):
    """Prediction = minus the transformer's output at time 1 - sigma: the velocity noise - x0,
    which ZImagePipeline hands the flow-matching Euler step."""
    family = family_of(ModelType.ZIMAGE)
    generator = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 16, 8, 8, generator=generator)
    caps = [torch.randn(5, 32, generator=generator), torch.randn(40, 32, generator=generator)]
    timesteps = torch.tensor([250.0, 900.0])
    with torch.no_grad():
        ours = family.predict(pipeline.transformer, noisy, timesteps, {"cap_feats": caps})
        out = pipeline.transformer(list(noisy.unsqueeze(2).unbind(0)), (1000 - timesteps) / 1000,
                                   caps, return_dict=False)[0]
    torch.testing.assert_close(ours, -torch.stack(out).squeeze(2))


def test_a_lora_trains_the_main_blocks_with_flow_matching_and_saves(lora_run):
    losses = run_json(lora_run.output_dir)["losses"]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    from safetensors import safe_open
    with safe_open(str(lora_run.output_dir / "final" / "pytorch_lora_weights.safetensors"),
                   "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("transformer.layers.") for k in keys), keys
    assert not any("refiner" in k for k in keys)  # the refiner blocks keep their weights


def test_zimage_pipeline_applies_the_saved_lora_as_trained(lora_run, zimage_folder):
    from diffusers import ZImagePipeline
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    final = lora_run.output_dir / "final"
    pipe = ZImagePipeline.from_pretrained(zimage_folder, local_files_only=True)
    pipe.load_lora_weights(str(final), weight_name="pytorch_lora_weights.safetensors",
                           adapter_name="default")
    loaded = get_peft_model_state_dict(pipe.transformer)
    saved = {k.removeprefix("transformer."): v for k, v in
             load_file(final / "pytorch_lora_weights.safetensors").items()}
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert any(saved[k].abs().sum() > 0 for k in saved if "lora_B" in k)  # it moved


def test_a_sample_is_drawn_with_the_flow_matching_euler_scheduler_and_cfg(lora_run):
    samples = sorted((lora_run.output_dir / "samples").glob("*.png"))
    assert len(samples) == 1, samples
    from PIL import Image
    assert Image.open(samples[0]).size == (64, 64)
