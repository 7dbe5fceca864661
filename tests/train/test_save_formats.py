"""Every save format through the trainer, read back by the tools users load them with."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from modules.config.schema import ModelType
from modules.models.single_file import load_single_file, save_single_file
from modules.models.tiny import ensure_builtin_model
from modules.train.trainer import train
from modules.models.families import family_files


def _base_folder(result) -> Path:
    return Path(json.loads((result.output_dir / "config.json").read_text())["model"]["path"])


def _lora_layers(module: torch.nn.Module) -> set[str]:
    return {n.split(".lora_A")[0] for n, _ in module.named_parameters() if ".lora_A" in n}


def test_lora_in_both_layouts_loads_in_diffusers_with_every_adapted_layer(tiny_config, pipelines):
    # proj_in / proj_out / ff layers are outside diffusers' attention-only key conversion: a
    # save that converts keys would drop them on load.
    targets = '["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.2"]'
    result = train(tiny_config("training.max_steps=4", f"training.lora_target_modules={targets}",
                               "components.text_encoder.train=true",
                               "training.lora_rank=4", "output.formats=diffusers,kohya"))
    final = result.output_dir / "final"
    assert {p.name for p in final.iterdir()} == {"pytorch_lora_weights.safetensors",
                                                 "lora_kohya.safetensors", "lora_kohya.json",
                                                 "tempera_step.json"}
    assert json.loads((final / "tempera_step.json").read_text()) == {"step": 4}
    pipe = pipelines.load(_base_folder(result))
    before = pipelines.image(pipe)
    images, layers = {}, {}
    for name in ("pytorch_lora_weights.safetensors", "lora_kohya.safetensors"):
        pipe.load_lora_weights(str(final), weight_name=name, adapter_name=name.split(".")[0])
        pipe.set_adapters(name.split(".")[0])
        images[name] = pipelines.image(pipe)
        layers[name] = _lora_layers(pipe.unet)
        pipe.unload_lora_weights()
    assert torch.allclose(pipelines.image(pipe), before), "unloading did not restore the base model"
    for name, image in images.items():
        assert not torch.allclose(image, before, atol=1e-4), f"{name} did not change the output"
        for kind in ("proj_in", "proj_out", "ff.net.2", "to_q"):
            assert any(layer.endswith(kind) for layer in layers[name]), f"{name}: no {kind} LoRA"
    assert torch.allclose(images["pytorch_lora_weights.safetensors"],
                          images["lora_kohya.safetensors"], atol=1e-4), \
        "the two layouts of the same LoRA render differently"
    with safe_open(str(final / "lora_kohya.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "4" and meta["ss_max_train_steps"] == "4"


def test_fine_tune_single_file_loads_back_with_the_trained_weights(tiny_config, pipelines):
    result = train(tiny_config("training.method=FINE_TUNE", "training.max_steps=2",
                               "output.formats=diffusers,single_file"))
    final = result.output_dir / "final"
    single = final / "model.safetensors"
    assert single.is_file() and (final / "model_index.json").is_file()
    base = _base_folder(result)
    loaded = load_single_file(single, ModelType.SD15, config_folder=base)
    tuned = pipelines.load(final)
    for name in ("unet", "vae", "text_encoder"):
        expected = getattr(tuned, name).state_dict()
        got = loaded[name].state_dict()
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[k], got[k]) for k in expected), name
    assert not torch.equal(loaded["unet"].conv_in.weight, pipelines.load(base).unet.conv_in.weight)
    with safe_open(str(single), "pt") as f:
        assert f.metadata()["modelspec.architecture"].startswith("stable-diffusion-v1")


def test_training_starts_from_a_single_file_checkpoint(tiny_config, tempera_cache, tmp_path):
    from diffusers import StableDiffusionPipeline
    folder = ensure_builtin_model("builtin:tiny-sd15", tempera_cache)
    pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None,
                                                   local_files_only=True)
    checkpoint = save_single_file({"unet": pipe.unet, "vae": pipe.vae,
                                   "text_encoder": pipe.text_encoder,
                                   "scheduler": pipe.scheduler},
                                  tmp_path / "my-model.safetensors", family_files(ModelType.SD15))
    before = checkpoint.read_bytes()
    result = train(tiny_config(f"model.path={checkpoint}", f"model.config_path={folder}",
                               "training.max_steps=3", 'output.formats=["DIFFUSERS", "KOHYA"]'))
    assert result.status == "finished" and result.steps == 3
    assert (result.output_dir / "final" / "pytorch_lora_weights.safetensors").is_file()
    assert checkpoint.read_bytes() == before, "training modified the user's checkpoint"
    # the kohya file names the checkpoint it was trained on by its hashes (A1111, Forge)
    with safe_open(str(result.output_dir / "final" / "lora_kohya.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_new_sd_model_hash"] == hashlib.sha256(before).hexdigest()
    assert meta["ss_sd_model_hash"] == hashlib.sha256(before[0x100000:0x110000]).hexdigest()[:8]
    # so does the diffusers file, by name and hash, never by its local path (issue 44)
    with safe_open(str(result.output_dir / "final" / "pytorch_lora_weights.safetensors"),
                   "pt") as f:
        peft_meta = f.metadata()
    assert peft_meta["ss_sd_model_name"] == "my-model.safetensors"
    assert peft_meta["ss_new_sd_model_hash"] == meta["ss_new_sd_model_hash"]
    assert str(tmp_path) not in json.dumps(peft_meta)
    resolved = json.loads((result.output_dir / "config.json").read_text())["model"]
    assert resolved["path"] == str(checkpoint)


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def test_diffusers_outputs_name_text_encoder_weights_as_every_stack_reads_them(tiny_config,
                                                                             pipelines):
    """The `text_model.` form (what transformers < 5.6, the kohya and single-file writers and
    A1111 use), the slow tokenizer files, and a round trip with identical weights."""
    lora = train(tiny_config("training.max_steps=1", "components.text_encoder.train=true",
                             "output.dir=" + str(Path(tiny_config().output.dir) / "lora")))
    keys = _keys(lora.output_dir / "final" / "pytorch_lora_weights.safetensors")
    text = [k for k in keys if k.startswith("text_encoder.")]
    assert text and all(k.startswith("text_encoder.text_model.encoder.layers.") for k in text)

    tuned = train(tiny_config("training.method=FINE_TUNE", "training.max_steps=1",
                              "components.text_encoder.train=true", "output.formats=diffusers",
                              "output.dir=" + str(Path(tiny_config().output.dir) / "ft")))
    final = tuned.output_dir / "final"
    assert all(k.startswith("text_model.") for k in _keys(final / "text_encoder" /
                                                            "model.safetensors"))
    assert {"vocab.json", "merges.txt", "tokenizer.json"} <= {
        p.name for p in (final / "tokenizer").iterdir()}
    from transformers import CLIPTokenizer
    slow = CLIPTokenizer.from_pretrained(final / "tokenizer")
    fast = pipelines.load(final).tokenizer
    assert slow("a red circle").input_ids == fast("a red circle").input_ids
    pipe = pipelines.load(final)
    base = pipelines.load(_base_folder(tuned))
    reloaded = pipe.text_encoder.state_dict()
    assert not all(torch.equal(reloaded[k], v) for k, v in base.text_encoder.state_dict().items())
    from safetensors.torch import load_file
    saved = load_file(str(final / "text_encoder" / "model.safetensors"))
    for key, value in reloaded.items():
        if "position_ids" in key:
            continue
        assert torch.equal(saved["text_model." + key if not key.startswith(("text_model.",
                                                                            "text_projection"))
                                 else key], value), key


def test_sd2_v_prediction_outputs_say_so_in_their_metadata(tiny_config):
    """SD 2.x (v-prediction): the kohya LoRA and the single-file checkpoint carry the metadata
    A1111 / ComfyUI read to pick the v-parameterisation."""
    sd2 = ("model.type=SD2", "model.path=builtin:tiny-sd2", "training.max_steps=1")
    lora = train(tiny_config(*sd2, "output.formats=kohya",
                             "output.dir=" + str(Path(tiny_config().output.dir) / "lora")))
    with safe_open(str(lora.output_dir / "final" / "lora_kohya.safetensors"), "pt") as f:
        meta, keys = f.metadata(), list(f.keys())
    assert meta["ss_v_parameterization"] == "True" and meta["ss_base_model_version"] == "sd_v2"
    assert meta["modelspec.architecture"] == "stable-diffusion-v2-768-v/lora"
    assert keys and all(k.startswith(("lora_unet_", "lora_te_")) for k in keys)
    full = train(tiny_config(*sd2, "training.method=FINE_TUNE", "output.formats=single_file",
                             "output.dir=" + str(Path(tiny_config().output.dir) / "full")))
    with safe_open(str(full.output_dir / "final" / "model.safetensors"), "pt") as f:
        meta, keys = f.metadata(), list(f.keys())
    assert meta["modelspec.architecture"] == "stable-diffusion-v2-768-v"
    assert meta["modelspec.prediction_type"] == "v"
    assert any(k.startswith("cond_stage_model.model.") for k in keys)  # SD 2's OpenCLIP layout
