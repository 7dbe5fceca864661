"""Flux.2 Klein on the tiny random-weight model (built once per session into the shared cache):
the folder it builds is what diffusers' Flux2KleinPipeline loads, the family encodes captions,
normalises and packs latents, shifts the noise level and calls the transformer exactly as that
pipeline does, and one shared LoRA run (10 steps at 64 px on the shapes dataset) trains both
block types with flow matching and saves a file Flux2KleinPipeline.load_lora_weights applies as
trained."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from modules.model_types import MODEL_TYPES, ModelType
from modules.models.families import family_of
from tests.train.test_resume import run_json

KLEIN = family_of(ModelType.KLEIN)
CAPTIONS = ["a red circle", "", "a small blue square on a large yellow triangle, seen from "
            "far above on a cloudy day with long shadows"]
# the adapted layers of both block types (the presets'): attention and feed-forward of the
# double-stream blocks, the fused input and output projections of the single-stream ones
# ("to_out": a Linear there, the double-stream blocks' ModuleList left out)
TARGETS = ('["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", '
           '"to_add_out", "linear_in", "linear_out", "to_qkv_mlp_proj", "to_out"]')


@pytest.fixture(scope="module")
def klein_folder(tempera_cache):
    from modules.models.tiny import ensure_builtin_model
    return ensure_builtin_model(MODEL_TYPES[ModelType.KLEIN].builtin, tempera_cache)


@pytest.fixture(scope="module")
def pipeline(klein_folder):
    from diffusers import Flux2KleinPipeline
    pipe = Flux2KleinPipeline.from_pretrained(klein_folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def bundle(klein_folder):
    return KLEIN.load_folder(klein_folder, None, torch.float32)


@pytest.fixture(scope="module")
def lora_run(klein_folder, tempera_cache, tmp_path_factory):
    """One LoRA run every assertion on a run's results reads (10 steps, 64 px, the shapes)."""
    from modules.config import Config, apply_overrides
    from modules.train.trainer import train
    out = tmp_path_factory.mktemp("klein-lora") / "out"
    config = apply_overrides(Config(), [
        f"general.cache_dir={tempera_cache}", f"output.dir={out}", "data.resolution=64",
        "model.type=KLEIN", "model.path=builtin:tiny-klein", "training.max_steps=10",
        "training.batch_size=2", "training.learning_rate=5e-2", "training.lora_rank=4",
        "training.lora_alpha=8", f"training.lora_target_modules={TARGETS}",
        "logging.tensorboard=false", 'output.formats=["DIFFUSERS"]',
        "loss.timestep_sampling=LOGIT_NORMAL", "loss.dynamic_shift=true",
        # every caption cached up front; a sample at the end with CFG (its negative prompt
        # encoded by the family: Flux2KleinPipeline takes it encoded only)
        "data.cache_text_encoder_outputs=true",
        'sampling.prompts=["a red circle"]', "sampling.sampler=EULER", "sampling.steps=2",
        "sampling.guidance_scale=4"])
    return train(config)


def test_the_tiny_model_is_a_klein_pipeline_shaped_like_the_real_one(pipeline, bundle):
    from transformers import Qwen3ForCausalLM, Qwen3Model
    assert type(pipeline.transformer).__name__ == "Flux2Transformer2DModel"
    assert type(pipeline.vae).__name__ == "AutoencoderKLFlux2"
    assert isinstance(pipeline.text_encoder, Qwen3ForCausalLM)  # as released
    assert isinstance(bundle.text_encoders["text_encoder"], Qwen3Model)  # trained without head
    config = pipeline.transformer.config
    assert config.in_channels == 4 * pipeline.vae.config.latent_channels == 128
    assert not config.guidance_embeds  # the base models have no guidance embedding
    assert config.joint_attention_dim == 3 * pipeline.text_encoder.config.hidden_size
    assert pipeline.text_encoder.config.num_hidden_layers > 27  # layer 27 inside, as in 4B
    assert not torch.equal(pipeline.vae.bn.running_mean, torch.zeros(128))  # statistics set
    prompt = pipeline.tokenizer.apply_chat_template(
        [{"role": "user", "content": "a cat"}], tokenize=False, add_generation_prompt=True,
        enable_thinking=False)
    assert prompt == ("<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
                      "<think>\n\n</think>\n\n")
    # REGIONAL compiles both of what diffusers declares repeated
    assert KLEIN.repeated_blocks == tuple(type(pipeline.transformer)._repeated_blocks) == (
        "Flux2TransformerBlock", "Flux2SingleTransformerBlock")


def test_captions_are_encoded_as_klein_pipeline_encodes_them(pipeline, bundle):
    ours = KLEIN.encode_text(bundle, CAPTIONS, torch.device("cpu"), None)
    with torch.no_grad():
        reference, text_ids = pipeline.encode_prompt(list(CAPTIONS))
    assert ours.hidden.shape == reference.shape == (3, 512, 3 * 16)
    assert ours.lengths is None  # padded to 512 as the pipeline pads: part of the condition
    torch.testing.assert_close(ours.hidden, reference, rtol=0, atol=0)
    conditioning = KLEIN.conditioning(ours, {}, 64, 64)
    assert torch.equal(conditioning["txt_ids"], text_ids[0])


def test_the_text_cache_of_one_family_is_never_read_for_the_other(bundle):
    """Klein 4B and Z-Image share Qwen3-4B's weights, but not the layers read or the template:
    the cache's identity has the model type, so the same encoder keys two folders."""
    from modules.train.recipe.text_store import encoder_identity
    as_zimage = replace(bundle, model_type=ModelType.ZIMAGE)
    assert encoder_identity(bundle) != encoder_identity(as_zimage)
    assert encoder_identity(bundle) == encoder_identity(replace(bundle))


def test_latents_are_normalised_and_packed_as_the_pipeline_does(pipeline, bundle):
    """The trainer's (32, h, w) latents, patchified and packed at the transformer's call, are
    the pipeline's own normalised tokens (its `_encode_vae_image`, `_pack_latents`)."""
    generator = torch.Generator().manual_seed(3)
    image = torch.rand(1, 3, 64, 96, generator=generator) * 2 - 1
    with torch.no_grad():
        mode = bundle.vae.encode(image).latent_dist.mode()
        ours = KLEIN.vae_latents(bundle.vae, mode)
        reference = pipeline._encode_vae_image(image, generator=None)
    assert ours.shape == (1, 32, 8, 12) and reference.shape == (1, 128, 4, 6)
    args, kwargs = KLEIN.denoiser_arguments(ours, torch.tensor([500.0]),
                                            {"encoder_hidden_states": None, "txt_ids": None})
    torch.testing.assert_close(kwargs["hidden_states"], pipeline._pack_latents(reference),
                               rtol=1e-6, atol=1e-6)
    latent_ids = pipeline._prepare_latent_ids(reference)[0]
    assert torch.equal(kwargs["img_ids"], latent_ids)
    with pytest.raises(ValueError, match="multiples of 16 pixels"):
        KLEIN.vae_latents(bundle.vae, torch.zeros(1, 32, 8, 7))


def test_the_family_calls_the_transformer_as_the_pipeline_does(pipeline, bundle):
    """Prediction = the transformer's output at sigma, unpacked to the latents' layout: the
    velocity noise - x0 that the pipeline hands the flow-matching Euler step."""
    generator = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 32, 8, 12, generator=generator)
    embeddings = KLEIN.encode_text(bundle, CAPTIONS[:2], torch.device("cpu"), None)
    timesteps = torch.tensor([250.0, 900.0])
    conditioning = KLEIN.conditioning(embeddings, {}, 64, 96)
    with torch.no_grad():
        ours = KLEIN.predict(pipeline.transformer, noisy, timesteps, conditioning)
        packed = pipeline._pack_latents(pipeline._patchify_latents(noisy))
        latent_ids = pipeline._prepare_latent_ids(pipeline._patchify_latents(noisy))
        prompt_embeds, text_ids = pipeline.encode_prompt(CAPTIONS[:2])
        out = pipeline.transformer(hidden_states=packed, timestep=timesteps / 1000,
                                   guidance=None, encoder_hidden_states=prompt_embeds,
                                   txt_ids=text_ids, img_ids=latent_ids, return_dict=False)[0]
        reference = pipeline._unpatchify_latents(
            pipeline._unpack_latents_with_ids(out, latent_ids, 4, 6))
    assert ours.shape == noisy.shape
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("height,width", [(512, 512), (1024, 1024), (768, 1344), (1344, 768),
                                          (1536, 640), (2048, 2048), (256, 1024)])
def test_the_shift_is_the_pipelines_for_the_image_token_count(pipeline, bundle, height, width):
    """loss.dynamic_shift's sigma is the pipeline's schedule shift for an image of this size:
    its mu from the token count its `prepare_latents` gives, through its scheduler's exponential
    time shift. (A token count of the unpacked latent's 2 x 2 patches of the *packed* grid,
    4x too small, gives another mu at every size here.)"""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    from modules.config import Config, apply_overrides
    latents, _ = pipeline.prepare_latents(1, 32, height, width, torch.float32,
                                          torch.device("cpu"), torch.Generator().manual_seed(0))
    tokens = latents.shape[1]
    assert tokens == (height // 16) * (width // 16)
    mu = compute_empirical_mu(image_seq_len=tokens, num_steps=50)
    assert mu != compute_empirical_mu(image_seq_len=tokens // 4, num_steps=50)
    normal = torch.linspace(-2.5, 2.5, 9)
    for sampling in ("UNIFORM", "LOGIT_NORMAL"):
        loss = apply_overrides(Config(), ["model.type=KLEIN", "loss.dynamic_shift=true",
                                          f"loss.timestep_sampling={sampling}"]).loss
        ours = KLEIN.objective.continuous_timesteps(bundle, normal, loss,
                                                    (height // 8, width // 8))
        unshifted = (torch.sigmoid(normal.double()) if sampling == "LOGIT_NORMAL"
                     else 0.5 * (1 + torch.erf(normal.double() / math.sqrt(2))))
        expected = pipeline.scheduler.time_shift(mu, 1.0, unshifted) * 1000
        torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=1e-4)
    # and the pipeline's own schedule at 50 steps runs through the same shift
    pipeline.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 50, 50), mu=mu)
    sigmas = torch.tensor(np.linspace(1.0, 1 / 50, 50))
    torch.testing.assert_close(pipeline.scheduler.sigmas[:-1].double(),
                               pipeline.scheduler.time_shift(mu, 1.0, sigmas), rtol=1e-5,
                               atol=1e-6)


def test_a_lora_trains_both_block_types_and_the_loss_goes_down(lora_run, klein_folder,
                                                              tempera_cache):
    """The run's losses are real numbers, and the trained LoRA lowers the flow-matching loss
    on the shapes it trained on (fixed noise and noise levels, base against trained), which a
    LoRA that did not train, or trained on a wrong target, would not."""
    losses = run_json(lora_run.output_dir)["losses"]
    assert len(losses) == 10 and all(math.isfinite(loss) for loss in losses)
    from safetensors import safe_open
    with safe_open(str(lora_run.output_dir / "final" / "pytorch_lora_weights.safetensors"),
                   "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("transformer.transformer_blocks.") for k in keys), keys
    assert any(k.startswith("transformer.single_transformer_blocks.") for k in keys), keys
    # the single blocks' output projection (BFL's linear2) too
    assert "transformer.single_transformer_blocks.1.attn.to_out.lora_A.weight" in keys
    assert all("blocks." in k for k in keys)  # not the embedders or the output layer
    base, trained = _fixed_losses(lora_run, klein_folder, tempera_cache)
    assert trained < 0.98 * base, (trained, base)  # 1.331 vs 1.396 as built


def _fixed_losses(lora_run, klein_folder, tempera_cache) -> tuple[float, float]:
    """The flow-matching loss on 8 of the shapes at fixed noise and sigmas: (base, trained)."""
    from PIL import Image
    from diffusers import Flux2KleinPipeline
    from modules.data.shapes import ensure_shapes_dataset
    folder = ensure_shapes_dataset(tempera_cache)
    images = sorted(p for p in folder.iterdir() if p.suffix == ".png")[:8]
    pixels = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB").resize(
        (64, 64)), dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1 for p in images])
    captions = [p.with_suffix(".txt").read_text(encoding="utf-8").strip() for p in images]
    pipe = Flux2KleinPipeline.from_pretrained(klein_folder, local_files_only=True)
    bundle = KLEIN.load_folder(klein_folder, None, torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        latents = KLEIN.vae_latents(bundle.vae, bundle.vae.encode(pixels).latent_dist.mean)
        conditioning = KLEIN.conditioning(
            KLEIN.encode_text(bundle, captions, torch.device("cpu"), None), {}, 64, 64)
        noise = torch.randn(latents.shape, generator=generator)
        timesteps = torch.linspace(100, 900, len(images))
        noisy, target = KLEIN.objective.noisy_and_target(bundle, latents, noise, timesteps)

        def loss() -> float:
            prediction = KLEIN.predict(pipe.transformer, noisy, timesteps, conditioning)
            return float(torch.nn.functional.mse_loss(prediction, target))
        base = loss()
        pipe.load_lora_weights(str(lora_run.output_dir / "final"),
                               weight_name="pytorch_lora_weights.safetensors")
        return base, loss()


def test_klein_pipeline_applies_the_saved_lora_as_trained(lora_run, klein_folder):
    """Every saved tensor loads as it was trained, the single blocks' `attn.to_out` among
    them, without peft's warning that the file's config and its tensors name different layers
    (the config's targets leave the double blocks' `to_out` ModuleList out by name)."""
    import warnings

    from diffusers import Flux2KleinPipeline
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    final = lora_run.output_dir / "final"
    pipe = Flux2KleinPipeline.from_pretrained(klein_folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    before = pipe(prompt="a red circle", height=64, width=64, num_inference_steps=2,
                  generator=torch.Generator().manual_seed(0), output_type="np").images
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.load_lora_weights(str(final), weight_name="pytorch_lora_weights.safetensors",
                               adapter_name="default")
    assert not [w for w in caught if "inconsistency" in str(w.message)]
    loaded = get_peft_model_state_dict(pipe.transformer, save_embedding_layers=False)
    saved = {k.removeprefix("transformer."): v for k, v in
             load_file(final / "pytorch_lora_weights.safetensors").items()}
    assert loaded.keys() == saved.keys()
    assert "single_transformer_blocks.0.attn.to_out.lora_B.weight" in saved
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert any(saved[k].abs().sum() > 0 for k in saved if "lora_B" in k)  # it moved
    after = pipe(prompt="a red circle", height=64, width=64, num_inference_steps=2,
                 generator=torch.Generator().manual_seed(0), output_type="np").images
    assert not np.allclose(before, after)  # the LoRA changes the output


def test_a_sample_is_drawn_with_the_flow_matching_euler_scheduler_and_cfg(lora_run):
    samples = sorted((lora_run.output_dir / "samples").glob("*.png"))
    assert len(samples) == 1, samples
    from PIL import Image
    assert Image.open(samples[0]).size == (64, 64)


def test_samples_from_cached_prompts_are_the_pipelines_own_pixel_for_pixel(pipeline, klein_folder,
                                                                           tmp_path):
    """Tempera's samples (`sample_images`: its pipeline over the live components, its
    scheduler, its seeded generator) at the base model's defaults, 50 steps and CFG 4, from
    the cached prompts with the text encoder gone from the run (on the meta device: any use
    of it would fail), are Flux2KleinPipeline's own images for the same seed, prompt, steps
    and guidance, every pixel (both run the same float32 operations in the same order on the
    CPU, so nothing is left to bound). The pipeline's own negative prompt is always empty (it takes
    another encoded only), so a prompt without one is compared as is and one with one is
    handed the pipeline's own encoding of it."""
    from modules.config import Config, apply_overrides
    from modules.config.prompts import SamplePrompt
    from modules.train.outputs.sampling import sample_images
    from modules.train.recipe.text_cache import TextEncoderCache
    from modules.train.recipe.text_store import TextEmbeddingStore, encoder_identity
    bundle = KLEIN.load_folder(klein_folder, None, torch.float32)
    cache = TextEncoderCache(bundle, torch.device("cpu"),
                             TextEmbeddingStore(tmp_path / "text", encoder_identity(bundle)))
    prompts = [SamplePrompt("a red circle", "", 32, 48, 42, 50, 4.0),
               SamplePrompt("a blue square", "a red circle", 48, 32, 7, 6, 3.5)]
    cache.precache(["a red circle", "a blue square", ""])
    bundle.text_encoders["text_encoder"].to("meta")  # left the run: only the cache answers
    assert cache.encoders_left()
    config = apply_overrides(Config(), ["model.type=KLEIN", "model.path=builtin:tiny-klein",
                                        "sampling.sampler=EULER"])
    ours = sample_images(bundle, config, prompts, torch.device("cpu"), 0, tmp_path,
                         text_cache=cache)
    assert [path.name for path, _, _ in ours] == ["step-000000-0.png", "step-000000-1.png"]
    for (path, _, image), prompt in zip(ours, prompts):
        negative = {}
        if prompt.negative:
            with torch.no_grad():
                negative["negative_prompt_embeds"] = pipeline.encode_prompt(prompt.negative)[0]
        own = pipeline(prompt=prompt.text, height=prompt.height, width=prompt.width,
                       num_inference_steps=prompt.steps, guidance_scale=prompt.guidance_scale,
                       generator=torch.Generator().manual_seed(prompt.seed), **negative).images[0]
        assert image.size == own.size == (prompt.width, prompt.height)
        from PIL import Image
        written = np.asarray(Image.open(path))
        assert np.array_equal(np.asarray(image), np.asarray(own)), prompt
        assert np.array_equal(written, np.asarray(own))
        assert np.asarray(own).std() > 0  # an image, not a blank


def test_a_distilled_models_samples_are_its_pipelines_own_without_cfg(klein_folder, tmp_path):
    """A step-distilled Klein trained anyway (model.train_distilled) samples as its pipeline
    does: the folder's `is_distilled` reaches Tempera's pipeline, which then skips CFG at any
    guidance (a pipeline built without it drew a CFG image the model was not made for)."""
    import json
    import shutil
    from diffusers import Flux2KleinPipeline
    from modules.config import Config, apply_overrides
    from modules.config.prompts import SamplePrompt
    from modules.train.outputs.saving import build_pipeline
    from modules.train.outputs.sampling import sample_images
    folder = tmp_path / "FLUX.2-klein-tiny"
    shutil.copytree(klein_folder, folder)
    index = folder / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "is_distilled": True}))
    bundle = KLEIN.load_folder(folder, None, torch.float32)
    config = apply_overrides(Config(), ["model.type=KLEIN", f"model.path={folder}",
                                        "model.train_distilled=true", "sampling.sampler=EULER"])
    assert build_pipeline(bundle, config).config.is_distilled
    assert not build_pipeline(KLEIN.load_folder(klein_folder, None, torch.float32),
                              config).config.is_distilled
    prompt = SamplePrompt("a red circle", "", 32, 32, 3, 4, 4.0)
    [(_, _, ours)] = sample_images(bundle, config, [prompt], torch.device("cpu"), 0, tmp_path)
    own = Flux2KleinPipeline.from_pretrained(folder, local_files_only=True)
    own.set_progress_bar_config(disable=True)
    image = own(prompt=prompt.text, height=32, width=32, num_inference_steps=4,
                guidance_scale=4.0, generator=torch.Generator().manual_seed(3)).images[0]
    assert np.array_equal(np.asarray(ours), np.asarray(image))


def test_every_preset_samples_at_the_pipelines_own_defaults():
    """A prompt added to any Klein preset samples as Flux2KleinPipeline does by default (its
    `__call__`'s steps and guidance) with its one sampler: the presets left DDIM, the config's
    default, which a run with a prompt then refused."""
    import inspect
    from pathlib import Path

    from diffusers import Flux2KleinPipeline
    from modules.config import apply_overrides, load_config
    from modules.config.validate import validate
    defaults = inspect.signature(Flux2KleinPipeline.__call__).parameters
    presets = sorted((Path(__file__).resolve().parents[2] / "training_presets" / "klein").glob(
        "*.json"))
    assert len(presets) >= 9
    for path in presets:
        sampling = load_config(path).sampling
        assert (sampling.sampler.value, sampling.steps, sampling.guidance_scale) == (
            "EULER", defaults["num_inference_steps"].default,
            defaults["guidance_scale"].default), path
        config = apply_overrides(load_config(path), ['sampling.prompts=["a red circle"]'])
        assert not [p for p in validate(config) if p.path.startswith("sampling.")], path
