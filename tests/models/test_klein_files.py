"""Flux.2 Klein's folders checked before anything is written (no weights loaded): the tiny
model's folder passes; another family's folder, a folder missing a component, a transformer
with the other size's text encoder and a step-distilled Klein are each refused, naming the
file and what to do; ComfyUI's split files are recognised by their keys, a swapped, wrong or
missing one named; the file layouts Klein has no writer for yet are refused up front."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from modules.config import Config, apply_overrides
from modules.model_types import MODEL_TYPES, ModelType
from modules.train.recipe.loss_checks import family_problems
from modules.train.setup.inputs import check_inputs


@pytest.fixture(scope="module")
def klein_folder(tempera_cache):
    from modules.models.tiny import ensure_builtin_model
    return ensure_builtin_model(MODEL_TYPES[ModelType.KLEIN].builtin, tempera_cache)


@pytest.fixture
def copy(klein_folder, tmp_path):
    """A copy of the tiny Klein's folder to break (configs and weights: 2 MB)."""
    target = tmp_path / "FLUX.2-klein-base-tiny"
    shutil.copytree(klein_folder, target)
    return target


def _model_problems(path, *overrides: str) -> dict[str, str]:
    config = apply_overrides(Config(), ["model.type=KLEIN", f"model.path={path}", *overrides])
    return {p.path: str(p) for p in check_inputs(config) if p.path.startswith("model.")}


def _edit(path, **changes) -> None:
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, **changes}))


def test_the_tiny_folder_passes(copy):
    assert _model_problems(copy) == {}


def test_another_familys_folder_names_the_model_type_to_set(copy):
    _edit(copy / "model_index.json", _class_name="ZImagePipeline")
    problems = _model_problems(copy)
    assert problems.keys() == {"model.type"}
    assert "ZIMAGE" in problems["model.type"] and "ZImagePipeline" in problems["model.type"]


def test_a_missing_component_is_named(copy):
    shutil.rmtree(copy / "vae")
    problems = _model_problems(copy)
    assert problems.keys() == {"model.path"} and "vae" in problems["model.path"]


def test_a_transformer_with_the_other_sizes_encoder_is_refused(copy):
    """A 9B transformer (caption features 3 x 4096) beside Qwen3-4B (2560), here in miniature."""
    _edit(copy / "text_encoder" / "config.json", hidden_size=24)
    problems = _model_problems(copy)
    assert problems.keys() == {"model.path"}
    message = problems["model.path"]
    assert "transformer/config.json" in message and "text_encoder/config.json" in message
    assert "48 = 3 layers x 16" in message and "24 wide" in message


def test_a_distilled_klein_is_refused_with_what_to_train_instead(copy):
    _edit(copy / "model_index.json", is_distilled=True)
    problems = _model_problems(copy)
    assert problems.keys() == {"model.path"}
    message = problems["model.path"]
    assert '"is_distilled": true' in message.replace("is_distilled: true",
                                                     '"is_distilled": true')
    assert "FLUX.2-klein-base-4B" in message and "model.train_distilled=true" in message
    assert _model_problems(copy, "model.train_distilled=true") == {}


# ComfyUI's three files, as their headers read: the diffusion model in BFL's original layout
# (fused qkv, the global modulations), Qwen3 as transformers saves it, the VAE as diffusers
# does; small tensors of the real layouts' names, the widths set per test
def _diffusion_model(path, caption_width):
    from safetensors.torch import save_file
    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2),
               "single_blocks.0.linear1.weight": torch.zeros(4, 2),
               "double_stream_modulation_img.lin.weight": torch.zeros(4, 2),
               "txt_in.weight": torch.zeros(2, caption_width)}, str(path))
    return path


def _qwen3(path, width):
    from safetensors.torch import save_file
    save_file({"model.embed_tokens.weight": torch.zeros(4, width),
               "model.layers.0.self_attn.q_norm.weight": torch.zeros(2)}, str(path))
    return path


def _vae(path, latent_channels):
    from safetensors.torch import save_file
    save_file({"encoder.conv_out.weight": torch.zeros(2 * latent_channels, 1, 1, 1),
               "decoder.conv_in.weight": torch.zeros(1, latent_channels, 1, 1)}, str(path))
    return path


@pytest.fixture
def split(tmp_path):
    """The 4B's three files (flux-2-klein-base-4b, qwen_3_4b, flux2-vae), by field."""
    return {"model.path": _diffusion_model(tmp_path / "flux-2-klein-base-4b.safetensors", 7680),
            "model.text_encoder_path": _qwen3(tmp_path / "qwen_3_4b.safetensors", 2560),
            "model.vae_path": _vae(tmp_path / "flux2-vae.safetensors", 32)}


def _split_problems(files: dict, tokenizer: bool = True) -> dict[str, str]:
    """The split files' problems, a tokenizer folder named unless `tokenizer` is False."""
    from modules.models.klein_files import split_file_problems
    named = {"model.tokenizer_path": Path(str(files["model.text_encoder_path"])).parent,
             **files} if tokenizer else files
    model = apply_overrides(Config(), ["model.type=KLEIN", *[f"{field}={path}" for field, path
                                                            in named.items()]]).model
    return {p.path: str(p) for p in split_file_problems(model)}


def test_three_right_files_are_recognised_and_need_a_tokenizer(split, klein_folder):
    from modules.models.klein_files import part_of
    from modules.models.split_files import keys_of
    assert [part_of(keys_of(split[f]))[0] for f in split] == ["transformer", "text_encoder",
                                                                "vae"]
    assert part_of(keys_of(split["model.path"]))[1].startswith("Klein 4B")
    problems = _split_problems(split, tokenizer=False)
    assert problems.keys() == {"model.tokenizer_path"} and "tokenizer" in str(problems)
    assert _split_problems({**split, "model.tokenizer_path": klein_folder}) == {}
    # through the run's own input checks too (the files are Klein's own settings)
    config_problems = _model_problems(split["model.path"],
                                      *[f"{f}={p}" for f, p in split.items() if f != "model.path"],
                                      f"model.tokenizer_path={klein_folder}")
    assert config_problems == {}, config_problems


@pytest.fixture(scope="module")
def comfyui_files(klein_folder, tmp_path_factory):
    """The tiny Klein as ComfyUI's three files: the diffusion model in BFL's layout, Qwen3
    under `model.` (with its tied head, as the released file has it), the VAE in BFL's
    ae.safetensors layout; and the folder's own bundle to compare with."""
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    from modules.models.families import family_of
    from modules.models.klein_files import to_original_names, vae_to_original
    bundle = family_of(ModelType.KLEIN).load_folder(klein_folder, None, torch.float32)
    root = tmp_path_factory.mktemp("klein-comfyui-files")
    paths = {"model.path": root / "flux-2-klein-base-tiny.safetensors",
             "model.text_encoder_path": root / "qwen_3_tiny.safetensors",
             "model.vae_path": root / "flux2-vae.safetensors"}
    save_file({k: v.contiguous() for k, v in to_original_names(
        bundle.denoiser.state_dict()).items()}, str(paths["model.path"]))
    causal = Qwen3ForCausalLM.from_pretrained(klein_folder, subfolder="text_encoder",
                                              local_files_only=True)
    save_file({k: v.contiguous().clone() for k, v in causal.state_dict().items()},
              str(paths["model.text_encoder_path"]))
    save_file({k: v.contiguous() for k, v in vae_to_original(bundle.vae).items()},
              str(paths["model.vae_path"]))
    return bundle, paths


def test_the_three_files_load_as_the_model_they_came_from(comfyui_files, klein_folder):
    """Each component loaded from ComfyUI's files (the diffusion model by diffusers'
    from_single_file, Qwen3, the VAE by Tempera's BFL conversion, in eval mode) equals the
    folder's bit for bit, and the tokenizer encodes a caption alike."""
    from modules.models.families import family_of
    bundle, paths = comfyui_files
    model = apply_overrides(Config(), ["model.type=KLEIN", f"model.config_path={klein_folder}",
                                       f"model.tokenizer_path={klein_folder}",
                                       *[f"{f}={p}" for f, p in paths.items()]]).model
    loaded = family_of(ModelType.KLEIN).load_single_file(paths["model.path"], model,
                                                         torch.float32)
    for name, module in bundle.components().items():
        want, got = module.state_dict(), loaded.component(name).state_dict()
        assert want.keys() == got.keys(), name
        for key in want:
            assert torch.equal(want[key], got[key]), f"{name}: {key}"
    assert not loaded.vae.training and not loaded.text_encoders["text_encoder"].training
    caption = "a red circle"
    assert (loaded.tokenizers["tokenizer"](caption).input_ids
            == bundle.tokenizers["tokenizer"](caption).input_ids)


def test_a_vae_file_of_another_layout_is_refused_naming_the_tensor(comfyui_files, tmp_path):
    from diffusers import AutoencoderKLFlux2
    from safetensors.torch import load_file, save_file

    from modules.models.klein_files import vae_from_original
    from modules.models.single_file import SingleFileError
    bundle, paths = comfyui_files
    tensors = load_file(str(paths["model.vae_path"]))
    del tensors["bn.running_var"]
    broken = tmp_path / "broken.safetensors"
    save_file(tensors, str(broken))
    vae = AutoencoderKLFlux2.from_config(bundle.vae.config)
    with pytest.raises(SingleFileError, match="has no bn.running_var"):
        vae_from_original(vae, load_file(str(broken)), str(broken))


def test_swapped_wrong_and_missing_files_are_each_named(split, tmp_path):
    swapped = _split_problems({**split, "model.text_encoder_path": split["model.vae_path"],
                               "model.vae_path": split["model.text_encoder_path"]})
    assert set(swapped) == {"model.text_encoder_path", "model.vae_path"}
    assert "flux2-vae.safetensors is Flux.2's 32-channel VAE" in swapped[
        "model.text_encoder_path"] and "belongs in model.vae_path" in swapped[
        "model.text_encoder_path"]
    assert "qwen_3_4b.safetensors is Qwen3-4B" in swapped["model.vae_path"]
    flux1_vae = _split_problems({**split, "model.vae_path": _vae(tmp_path / "ae.safetensors",
                                                                  16)})
    assert set(flux1_vae) == {"model.vae_path"} and "16 latent channels" in flux1_vae[
        "model.vae_path"]
    missing = _split_problems({**split, "model.vae_path": ""})
    assert set(missing) == {"model.vae_path"} and "models/vae" in missing["model.vae_path"]
    lora = tmp_path / "lora.safetensors"
    from safetensors.torch import save_file
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight":
               torch.zeros(2, 2)}, str(lora))
    wrong = _split_problems({**split, "model.path": lora})
    assert set(wrong) == {"model.path"} and "a LoRA" in wrong["model.path"]


def test_a_9b_diffusion_model_beside_qwen3_4b_is_refused_naming_both(split, tmp_path):
    nine = _diffusion_model(tmp_path / "flux-2-klein-base-9b.safetensors", 12288)
    problems = _split_problems({**split, "model.path": nine})
    assert set(problems) == {"model.text_encoder_path"}, problems
    message = problems["model.text_encoder_path"]
    assert "flux-2-klein-base-9b.safetensors reads captions 12288 wide" in message
    assert "qwen_3_4b.safetensors is 2560 wide" in message


def test_every_layout_is_accepted_for_klein():
    for method, fmt in (("LORA", "KOHYA"), ("FINE_TUNE", "SINGLE_FILE")):
        config = apply_overrides(Config(), ["model.type=KLEIN", f"training.method={method}",
                                            f'output.formats=["DIFFUSERS", "{fmt}"]'])
        assert family_problems(config) == []


def _random_transformer(klein_folder):
    """The tiny transformer with every weight random (norm scales and biases too), so a
    misplaced or unswapped tensor shows."""
    from diffusers import Flux2Transformer2DModel
    transformer = Flux2Transformer2DModel.from_pretrained(klein_folder, subfolder="transformer",
                                                          local_files_only=True)
    generator = torch.Generator().manual_seed(5)
    for param in transformer.parameters():
        param.data = torch.randn(param.shape, generator=generator)
    return transformer


def test_the_bfl_file_is_what_diffusers_single_file_reader_reads_back_exactly(klein_folder,
                                                                               tmp_path):
    """ComfyUI's diffusion-model file (BFL's layout: q/k/v fused into `qkv`, the final
    modulation's halves swapped, norms as `.scale`): diffusers' own
    Flux2Transformer2DModel.from_single_file reproduces every weight bit for bit, and the
    file is recognised as a Klein diffusion model by its keys."""
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import load_file

    from modules.models.klein_files import is_transformer_file, save_transformer_file
    transformer = _random_transformer(klein_folder)
    path = save_transformer_file(transformer, tmp_path / "klein.safetensors")
    saved = load_file(str(path))
    assert "double_blocks.0.img_attn.qkv.weight" in saved
    assert "single_blocks.1.linear1.weight" in saved and "final_layer.linear.weight" in saved
    assert not any(k.startswith(("transformer_blocks.", "single_transformer_blocks."))
                   for k in saved)
    assert is_transformer_file(path)
    back = Flux2Transformer2DModel.from_single_file(str(path), config=str(klein_folder),
                                                    subfolder="transformer",
                                                    local_files_only=True,
                                                    torch_dtype=torch.float32)
    want, got = transformer.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key


def test_a_full_fine_tune_saves_a_diffusers_folder_and_comfyuis_file(tiny_config, klein_folder):
    """2 steps of FINE_TUNE with SINGLE_FILE: final/model.safetensors read by diffusers'
    from_single_file is final/'s trained transformer exactly."""
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    from modules.train.trainer import train
    result = train(tiny_config("model.type=KLEIN", "model.path=builtin:tiny-klein",
                               "training.method=FINE_TUNE", "training.max_steps=2",
                               "sampling.sampler=EULER",
                               'output.formats=["DIFFUSERS", "SINGLE_FILE"]'))
    final = result.output_dir / "final"
    pipe = Flux2KleinPipeline.from_pretrained(final, local_files_only=True)
    single = Flux2Transformer2DModel.from_single_file(
        str(final / "model.safetensors"), config=str(klein_folder), subfolder="transformer",
        local_files_only=True, torch_dtype=torch.float32)
    want, got = pipe.transformer.state_dict(), single.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    base = Flux2Transformer2DModel.from_pretrained(klein_folder, subfolder="transformer")
    key = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(base.state_dict()[key], want[key])  # it trained


def test_lokr_is_written_in_the_diffusers_layout_klein_pipeline_loads(tiny_config, klein_folder):
    """LoKr with DIFFUSERS output is accepted for Klein (refused for Z-Image, whose pipeline
    has no such loader); 2 LoKr steps: Flux2KleinPipeline.load_lora_weights builds a LoKr
    adapter with the run's alpha and rank and loads every saved factor bit for bit, the
    single blocks' output projection (`to_out`) among them, and the transformer's output
    changes."""
    from diffusers import Flux2KleinPipeline
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from modules.config.validate import validate
    from modules.train.trainer import train
    settings = ["training.adapter=LOKR", "training.lora_rank=4", "training.lora_alpha=8",
                'output.formats=["DIFFUSERS"]', "sampling.sampler=EULER"]
    zimage = apply_overrides(Config(), ["model.type=ZIMAGE", "model.path=builtin:tiny-zimage",
                                        *settings])
    assert [p.path for p in validate(zimage)] == ["output.formats[0]"]
    config = tiny_config("model.type=KLEIN", "model.path=builtin:tiny-klein",
                         "training.max_steps=2", *settings,
                         'training.lora_target_modules=["to_q", "to_out.0", "to_out"]')
    assert validate(config) == [] and family_problems(config) == []
    final = train(config).output_dir / "final"
    saved = {k.removeprefix("transformer."): v
             for k, v in load_file(final / "pytorch_lora_weights.safetensors").items()}
    assert saved and all(".lokr_" in k for k in saved)
    assert {k.split(".lokr_")[0] for k in saved if "single_" in k} == {
        f"single_transformer_blocks.{i}.attn.to_out" for i in (0, 1)}
    pipe = Flux2KleinPipeline.from_pretrained(klein_folder, local_files_only=True)
    plain = _forward_klein(pipe.transformer)
    pipe.load_lora_weights(str(final), weight_name="pytorch_lora_weights.safetensors")
    (adapter,) = pipe.transformer.peft_config.values()
    assert type(adapter).__name__ == "LoKrConfig" and (adapter.r, adapter.alpha) == (4, 8)
    loaded = get_peft_model_state_dict(pipe.transformer, save_embedding_layers=False,
                                       adapter_name=next(iter(pipe.transformer.peft_config)))
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert not torch.allclose(_forward_klein(pipe.transformer), plain, atol=1e-5)


def _forward_klein(transformer) -> torch.Tensor:
    from tests.lora_tools.test_klein_lora_tools import _forward
    return _forward(transformer)


def test_a_lora_trains_from_comfyuis_three_files(comfyui_files, klein_folder, tiny_config):
    """2 LoRA steps from the three files (the loader's single-file path, the family's
    `load_single_file`): the run saves a LoRA whose factors moved."""
    from safetensors.torch import load_file

    from modules.train.trainer import train
    _, paths = comfyui_files
    result = train(tiny_config("model.type=KLEIN", "training.max_steps=2",
                               "sampling.sampler=EULER", f"model.config_path={klein_folder}",
                               f"model.tokenizer_path={klein_folder}",
                               *[f"{f}={p}" for f, p in paths.items()]))
    saved = load_file(result.output_dir / "final" / "pytorch_lora_weights.safetensors")
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)


def test_a_single_files_configs_are_those_of_its_size(split, tmp_path):
    """The loader, the memory plan and the LoRA tools read a Klein file's architecture from
    the shipped configs of its size (the caption width its diffusion model reads)."""
    from modules.models.families import family_files
    from modules.models.single_file import config_folder_for
    from modules.train.memory.memory_plan import config_folders
    nine = _diffusion_model(tmp_path / "flux-2-klein-base-9b.safetensors", 12288)
    files = family_files(ModelType.KLEIN)
    assert config_folder_for(files, split["model.path"]).name == "klein4b"
    assert config_folder_for(files, nine).name == "klein9b"
    config = apply_overrides(Config(), ["model.type=KLEIN", f"model.path={nine}"])
    assert config_folders(config, nine).name == "klein9b"


@pytest.mark.parametrize("size, depth, single, hidden",
                         [("klein4b", 5, 20, 3072), ("klein9b", 8, 24, 4096)])
def test_comfyui_detects_the_saved_layout_as_flux2_at_full_size(comfyui, caplog, size, depth,
                                                                single, hidden):
    """ComfyUI's own model detection (skipped without `pytest --comfyui=PATH`) on the layout
    Tempera writes for a weightless full-size Klein 4B and 9B (the shipped configs, on the meta
    device): Flux.2 with the size's double and single depth and hidden size, reading its
    caption width; the model ComfyUI builds from that takes every tensor, each of its shape
    (ComfyUI's own `load_model_weights`, nothing missing or unexpected)."""
    import logging

    from diffusers import Flux2Transformer2DModel

    from modules.models.klein_files import to_original_names
    from modules.models.single_file import CONFIGS_DIR
    config = Flux2Transformer2DModel.load_config(CONFIGS_DIR / size / "transformer")
    with torch.device("meta"):
        transformer = Flux2Transformer2DModel.from_config(config)
    saved = to_original_names(transformer.state_dict())
    detected = comfyui.model_detection.detect_unet_config(saved, "")
    assert detected["image_model"] == "flux2"
    assert (detected["depth"], detected["depth_single_blocks"], detected["hidden_size"],
            detected["context_in_dim"]) == (depth, single, hidden, config["joint_attention_dim"])
    found = comfyui.model_detection.model_config_from_unet(saved, "")
    assert type(found).__name__ == "Flux2"
    model = found.get_model(saved, "", device=torch.device("meta"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        model.load_model_weights(dict(saved), "", assign=True)
    assert not [r for r in caplog.records if "unet " in r.getMessage()]
    theirs = {k: tuple(v.shape) for k, v in model.diffusion_model.state_dict().items()}
    assert theirs == {k: tuple(v.shape) for k, v in saved.items()}


def test_comfyui_loads_every_tensor_of_a_saved_klein_file(comfyui, klein_folder, tmp_path):
    """The tiny Klein's saved file is detected as Flux.2 of its depths and width; ComfyUI's
    Flux.2 fixes the attention head at 128 wide (hidden // 128 heads: none for the tiny's 32)
    and the timestep embedding at 256 channels, so it cannot build the tiny model. A small one
    of those widths (one head, one block of each kind), saved by Tempera's writer, is loaded
    by ComfyUI's own diffusion-model loader (comfy.sd.load_diffusion_model_state_dict, on the
    CPU) with every tensor equal to the file's."""
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import load_file

    from modules.models.klein_files import save_transformer_file
    from modules.models.tiny_klein import TINY_KLEIN
    tiny = save_transformer_file(_random_transformer(klein_folder), tmp_path / "tiny.safetensors")
    detected = comfyui.model_detection.detect_unet_config(load_file(str(tiny)), "")
    assert (detected["image_model"], detected["depth"], detected["depth_single_blocks"],
            detected["hidden_size"], detected["num_heads"]) == ("flux2", 2, 2, 32, 0)
    config = dict(TINY_KLEIN["transformer"], attention_head_dim=128, num_attention_heads=1,
                  num_layers=1, num_single_layers=1, axes_dims_rope=[32, 32, 32, 32],
                  timestep_guidance_channels=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        small = Flux2Transformer2DModel.from_config(config)
    path = save_transformer_file(small, tmp_path / "small.safetensors")
    tensors = load_file(str(path))
    patcher = comfyui.sd.load_diffusion_model_state_dict(dict(tensors))
    assert type(patcher.model).__name__ == "Flux2"
    loaded = patcher.model.diffusion_model.state_dict()
    assert loaded.keys() == tensors.keys()
    for key, value in tensors.items():
        assert torch.equal(loaded[key].to(value.dtype), value), key
