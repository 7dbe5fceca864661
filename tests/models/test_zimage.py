"""Z-Image, the first transformer family, on the tiny random-weight model (built once per
session into the shared cache): the folder it builds is what diffusers' ZImagePipeline loads,
the family encodes captions and calls the transformer exactly as that pipeline does, and one
shared LoRA run (3 steps at 64 px) trains the main blocks with flow matching and saves a file
ZImagePipeline.load_lora_weights applies as trained."""
from __future__ import annotations

import math

import pytest
import torch

from modules.model_types import ModelType
from modules.models.families import family_of
from tests.train.test_resume import run_json

CAPTIONS = ["a red circle", "", "a small blue square on a large yellow triangle, seen from "
            "far above on a cloudy day with long shadows"]


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
        'output.formats=["DIFFUSERS", "KOHYA"]',
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


def _trained_deltas(lora_run, zimage_folder):
    """Each adapted layer's weight update as trained: the transformer with the saved diffusers
    file applied (which the test above shows is the trained adapter), peft's own delta."""
    from diffusers import ZImagePipeline
    from modules.models.kohya import adapter_layers
    pipe = ZImagePipeline.from_pretrained(zimage_folder, local_files_only=True)
    pipe.load_lora_weights(str(lora_run.output_dir / "final"),
                           weight_name="pytorch_lora_weights.safetensors", adapter_name="default")
    return pipe.transformer, {path: layer.get_delta_weight("default").detach()
                              for path, layer in adapter_layers(pipe.transformer).items()}


def test_diffusers_applies_the_comfyui_file_as_trained(lora_run, zimage_folder):
    """The file for ComfyUI (output.formats KOHYA) loads in ZImagePipeline too, alpha folded in:
    the transformer then predicts what the trained one predicts."""
    from diffusers import ZImagePipeline
    trained, _ = _trained_deltas(lora_run, zimage_folder)
    pipe = ZImagePipeline.from_pretrained(zimage_folder, local_files_only=True)
    pipe.load_lora_weights(str(lora_run.output_dir / "final"),
                           weight_name="lora_kohya.safetensors")
    generator = torch.Generator().manual_seed(1)
    x = [torch.randn(16, 1, 8, 8, generator=generator)]
    caps = [torch.randn(7, 32, generator=generator)]
    t = torch.tensor([0.3])
    with torch.no_grad():
        want = trained(x, t, caps).sample[0]
        got = pipe.transformer(x, t, caps).sample[0]
        base = pipe.transformer(x, t, caps, joint_attention_kwargs={"scale": 0.0}).sample[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, base)  # the LoRA does something


def _comfyui_applied(comfyui, transformer, lora: dict, caplog) -> dict[str, torch.Tensor]:
    """What ComfyUI's own code (comfy.lora: model_lora_keys_unet for a Z-Image model,
    load_lora, calculate_weight) adds to each diffusers layer's weight from the LoRA file
    `lora`; fails on any tensor of the file it leaves unmapped."""
    import logging
    from types import SimpleNamespace
    config = transformer.config
    unet_config = {"n_layers": config.n_layers, "dim": config.dim,
                   "n_refiner_layers": config.n_refiner_layers}
    # a Z-Image model as ComfyUI holds one: its class (Lumina2) and its weights' names
    model = comfyui.model_base.Lumina2.__new__(comfyui.model_base.Lumina2)
    torch.nn.Module.__init__(model)
    model.model_config = SimpleNamespace(unet_config=unet_config)
    names = comfyui.utils.z_image_to_diffusers(unet_config, output_prefix="diffusion_model.")
    comfy_keys = {v if isinstance(v, str) else v[0] for v in names.values()}
    model.state_dict = lambda: {k: None for k in comfy_keys}
    key_map = comfyui.lora.model_lora_keys_unet(model, {})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        patches = comfyui.lora.load_lora(lora, key_map)
    assert not [r for r in caplog.records if "not loaded" in r.getMessage()]
    weights = {k.replace(".base_layer", ""): v for k, v in transformer.named_parameters()}
    applied = {}
    for name, target in key_map.items():
        path = name.removeprefix("diffusion_model.")
        # the diffusers names the file uses (the map also holds ComfyUI's own names)
        if target not in patches or name == path or f"{path}.weight" not in weights:
            continue
        key, offset = target if isinstance(target, tuple) else (target, None)
        shape = ((3 * config.dim, config.dim) if offset is not None
                 else weights[f"{path}.weight"].shape)
        weight = comfyui.lora.calculate_weight([(1.0, patches[target], 1.0, offset, None)],
                                               torch.zeros(shape), key)
        applied[path] = weight.narrow(*offset) if offset is not None else weight
    return applied


def test_comfyui_maps_every_key_and_applies_the_trained_update(lora_run, zimage_folder,
                                                              comfyui, caplog):
    """ComfyUI maps every tensor of the trained file onto its fused-attention model and applies
    exactly the update each layer trained."""
    from safetensors.torch import load_file
    transformer, deltas = _trained_deltas(lora_run, zimage_folder)
    lora = load_file(lora_run.output_dir / "final" / "lora_kohya.safetensors")
    applied = _comfyui_applied(comfyui, transformer, lora, caplog)
    assert applied.keys() == deltas.keys()
    for path, delta in deltas.items():
        torch.testing.assert_close(applied[path], delta, rtol=1e-5, atol=1e-7)


def random_adapter_file(zimage_folder, tmp_path, adapter: tuple[str, ...]):
    """The tiny transformer with `adapter` on its main blocks, every adapter tensor random,
    saved as the KOHYA file: (the transformer, the file's path, each layer's peft update)."""
    from modules.config import Config, apply_overrides
    from modules.models.kohya import adapter_layers, save_kohya_lora
    from modules.train.recipe.adapters import add_adapter
    config = apply_overrides(Config(), ["model.type=ZIMAGE", "training.lora_rank=4",
                                        "training.lora_alpha=6", *adapter,
                                        'training.lora_target_modules=["to_q", "to_k", '
                                        '"to_v", "to_out.0", "w1", "w2", "w3"]'])
    transformer = family_of(ModelType.ZIMAGE).load_folder(zimage_folder, None,
                                                          torch.float32).denoiser
    transformer.requires_grad_(False)
    add_adapter(transformer, config, denoiser=True,
                scope=family_of(ModelType.ZIMAGE).lora_scope)
    generator = torch.Generator().manual_seed(5)
    for param in transformer.parameters():
        if param.requires_grad:
            param.data = torch.randn(param.shape, generator=generator) * 0.2
    path = save_kohya_lora({"transformer": transformer}, tmp_path / "lora.safetensors", None,
                           ModelType.ZIMAGE)
    deltas = {p: layer.get_delta_weight("default").detach()
              for p, layer in adapter_layers(transformer).items()}
    return transformer, path, deltas


@pytest.mark.parametrize("adapter", [("training.adapter=LORA", "training.use_rslora=true"),
                                     ("training.adapter=LOHA",),
                                     ("training.adapter=LOKR", "training.lokr_factor=4")],
                         ids=["lora-rslora", "loha", "lokr"])
def test_comfyui_applies_every_adapter_kind_as_built(zimage_folder, comfyui, caplog, tmp_path,
                                                    adapter):
    """LoRA (rsLoRA's alpha), LoHa and LoKr on the main blocks, every tensor random: the file
    ComfyUI reads gives each layer peft's own update (no training run: the adapters are set)."""
    from safetensors.torch import load_file
    transformer, path, deltas = random_adapter_file(zimage_folder, tmp_path, adapter)
    assert all(p.startswith("layers.") for p in deltas) and len(deltas) == 2 * 7
    applied = _comfyui_applied(comfyui, transformer, load_file(path), caplog)
    assert applied.keys() == deltas.keys()
    for p, delta in deltas.items():
        torch.testing.assert_close(applied[p], delta, rtol=1e-4, atol=1e-6)


def test_diffusers_applies_a_lokr_file_as_built(zimage_folder, tmp_path):
    """The KOHYA LoKr file (LoKr has no DIFFUSERS file) through ZImagePipeline's own
    load_lora_weights: every layer gets peft's update as built, not a loader that returns
    and attaches nothing (docs/zimage.md names the loaders that apply a LoKr)."""
    from diffusers import ZImagePipeline
    _, path, deltas = random_adapter_file(zimage_folder, tmp_path,
                                          ("training.adapter=LOKR", "training.lokr_factor=4"))
    pipe = ZImagePipeline.from_pretrained(zimage_folder, local_files_only=True)
    pipe.load_lora_weights(str(path))
    assert_lokr_loaded_as(pipe.transformer, deltas)


def assert_lokr_loaded_as(transformer, deltas: dict[str, torch.Tensor]) -> None:
    """A loader attached LoKr layers where `deltas` ({module path: update}) has one and nowhere
    else, each giving peft's update as built."""
    loaded = {name: module for name, module in transformer.named_modules()
              if hasattr(module, "lokr_w1")}
    assert loaded.keys() == deltas.keys()
    for name, delta in deltas.items():
        adapter_name = next(iter(loaded[name].lokr_w1))
        torch.testing.assert_close(loaded[name].get_delta_weight(adapter_name), delta,
                                   rtol=1e-5, atol=1e-7)
