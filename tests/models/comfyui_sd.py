"""ComfyUI's own checkpoint and LoRA loading for the tiny SD 1.x / SDXL models (the checkout
`pytest --comfyui=PATH` names, imported by `comfyui_harness.import_comfyui`).

ComfyUI's checkpoint loader (`comfy.sd.load_state_dict_guess_config`) first detects the
architecture from the file (`model_detection.detect_unet_config`), then picks the supported
model whose fixed `unet_config` fields all match (`model_config_from_unet`). The detection
runs on the tiny models as on full-size ones; the match cannot: the tiny UNets have
`model_channels` 32 where every SD model ComfyUI knows has 320 (and `context_dim` 32 / 64, not
768 / 1024 / 2048; the tiny SDXL's `transformer_depth` and `adm_in_channels` differ too).
`load_checkpoint` therefore takes the step after the match itself: the class the full-size
model matches (`supported_models.SD15`, `SDXL`), given the detected config, then ComfyUI's own
`get_model` / `load_model_weights` (its UNet class, built at the tiny size) and its
`process_clip_state_dict` key conversion. ComfyUI's CLIP wrappers read fixed full-size
configs (`sd1_clip_config.json`, `clip_config_bigg.json`), so the text encoders are ComfyUI's
own `SDClipModel` (its CLIP implementation) built with the tiny encoders' configs.
"""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from transformers import CLIPTextConfig

from modules.model_types import ModelType

UNET_PREFIX = "model.diffusion_model."
# ComfyUI's supported model each family's full-size checkpoint matches, and the names of its
# text encoders (clip_l, clip_g) with the diffusers folder each one's config comes from
COMFY_CLASS = {ModelType.SD15: "SD15", ModelType.SDXL: "SDXL"}
ENCODERS = {ModelType.SD15: {"clip_l": "text_encoder"},
            ModelType.SDXL: {"clip_l": "text_encoder", "clip_g": "text_encoder_2"}}


def load_checkpoint(comfy, path: Path, model_type: ModelType, folder: Path, caplog):
    """(ModelPatcher of the UNet, CLIP) loaded by ComfyUI's code from the single file `path`
    (`folder`: the diffusers folder whose text encoder configs build ComfyUI's CLIP at the
    tiny size); fails on any tensor of the file that does not land in ComfyUI's models."""
    state = load_file(str(path))
    detected = comfy.model_detection.detect_unet_config(state, UNET_PREFIX)
    config = getattr(comfy.supported_models, COMFY_CLASS[model_type])(detected)
    if config.unet_config.get("num_head_channels", -1) > detected["model_channels"]:
        # ComfyUI's SDXL fixes 64 channels per head, wider than the tiny UNet's 32 channels
        # (it would build 0 heads of 64); the split into heads shapes no weight
        config.unet_config["num_head_channels"] = 8
    cpu = torch.device("cpu")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        model = config.get_model(state, UNET_PREFIX, device=cpu)
        model.load_model_weights(state, UNET_PREFIX)
    assert not [r.getMessage() for r in caplog.records if "unet " in r.getMessage()]
    clip_state = config.process_clip_state_dict(state)
    encoders = torch.nn.Module()
    for name, subfolder in ENCODERS[model_type].items():
        hf = CLIPTextConfig.from_pretrained(folder / subfolder).to_dict()
        setattr(encoders, name, comfy.sd1_clip.SDClipModel(
            textmodel_json_config=hf, dtype=torch.float32, model_options={"model_name": name}))
    clip_state = {k: v for k, v in clip_state.items() if k.split(".")[0] in ENCODERS[model_type]}
    # ComfyUI's CLIP always has CLIP's 49408-token vocabulary (its tokenizer is fixed); the
    # tiny tokenizer has a few hundred tokens, so those rows are left out of the load (the
    # LoRA files never touch them) and kept in `token_embeddings` for the tests to compare
    tokens = {k: clip_state.pop(k) for k in list(clip_state) if k.endswith("token_embedding.weight")}
    missing, unexpected = encoders.load_state_dict(clip_state, strict=False)
    # ComfyUI's CLIP holds a text projection (and logit scale) for every encoder; the tiny
    # SD 1.5's CLIPTextModel has none, as full-size SD 1.5 files have none
    assert unexpected == [] and all(k in tokens or "text_projection" in k or "logit_scale" in k
                                    for k in missing), missing
    clip = comfy.sd.CLIP(no_init=True)
    clip.cond_stage_model = encoders
    clip.patcher = comfy.model_patcher.ModelPatcher(encoders, load_device=cpu,
                                                    offload_device=cpu)
    clip.tokenizer, clip.layer_idx, clip.tokenizer_options = None, None, {}
    clip.use_clip_schedule, clip.apply_hooks_to_conds = False, None
    unet = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    loaded = SimpleNamespace(unet=unet, clip=clip, config=config, detected=detected,
                             token_embeddings=tokens, clip_keys=set(clip_state))
    loaded.weights = weights(unet, clip, loaded.clip_keys)
    return loaded


def weights(unet, clip, clip_keys: set[str]) -> dict[str, torch.Tensor]:
    """Every tensor the file loaded into ComfyUI's UNet (`diffusion_model.…`) and CLIP
    (`clip_l.…`, `clip_g.…`), copied."""
    out = {k: v.detach().clone() for k, v in unet.model.state_dict().items()
           if k.startswith("diffusion_model.")}
    out.update({k: v.detach().clone() for k, v in clip.cond_stage_model.state_dict().items()
                if k in clip_keys})
    return out


def apply_lora(comfy, loaded, lora_path: Path, strength: float, caplog) -> dict[str, torch.Tensor]:
    """The weights after ComfyUI's LoraLoader path (`comfy.sd.load_lora_for_models`, then the
    patchers' `patch_model`) applies the file at `strength` to model and CLIP; fails on any
    tensor of the file ComfyUI does not load."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        unet, clip = comfy.sd.load_lora_for_models(loaded.unet, loaded.clip,
                                                   load_file(str(lora_path)), strength, strength)
    # what comfy.lora / comfy.sd log for a key they leave out or a patch they cannot apply
    refused = ("not loaded", "NOT LOADED", "SHAPE MISMATCH", "Calculate Weight Failed",
               "not recognized")
    assert not [r.getMessage() for r in caplog.records
                if any(marker in r.getMessage() for marker in refused)]
    cpu = torch.device("cpu")
    unet.patch_model(device_to=cpu, force_patch_weights=True)
    clip.patcher.patch_model(device_to=cpu, force_patch_weights=True)
    try:
        return weights(unet, clip, loaded.clip_keys)
    finally:
        unet.unpatch_model(device_to=cpu)
        clip.patcher.unpatch_model(device_to=cpu)


def comfy_names(state: dict[str, torch.Tensor], model_type: ModelType,
                folder: Path) -> dict[str, str]:
    """{kohya name: ComfyUI weight key} for every weight of the single file's `state`, made
    without ComfyUI: text encoders by their transformers names (ComfyUI's CLIP keeps them
    under `clip_l.transformer.` / `clip_g.transformer.`); the UNet by its ldm names for SDXL
    (kohya's SDXL names), by diffusers' own ldm -> diffusers converter for SD 1.x (kohya's
    SD 1.x names are diffusers module paths)."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
    names = {}
    prefixes = {"clip_l": "lora_te1_" if model_type == ModelType.SDXL else "lora_te_",
                "clip_g": "lora_te2_"}
    for encoder in ENCODERS[model_type]:
        config = CLIPTextConfig.from_pretrained(folder / ENCODERS[model_type][encoder])
        for layer in range(config.num_hidden_layers):
            for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                         "self_attn.out_proj", "mlp.fc1", "mlp.fc2"):
                path = f"text_model.encoder.layers.{layer}.{part}"
                names[prefixes[encoder] + path.replace(".", "_")] = \
                    f"{encoder}.transformer.{path}.weight"
    unet = {k.removeprefix(UNET_PREFIX): v for k, v in state.items() if k.startswith(UNET_PREFIX)}
    if model_type == ModelType.SDXL:
        names.update({"lora_unet_" + k.removesuffix(".weight").replace(".", "_"):
                      "diffusion_model." + k for k in unet if k.endswith(".weight")})
        return names
    by_tensor = {id(v): k for k, v in unet.items()}
    converted = convert_ldm_unet_checkpoint(
        {UNET_PREFIX + k: v for k, v in unet.items()},
        UNet2DConditionModel.load_config(folder / "unet"))
    for key, value in converted.items():
        if key.endswith(".weight"):
            names["lora_unet_" + key.removesuffix(".weight").replace(".", "_")] = \
                "diffusion_model." + by_tensor[id(value)]
    return names


def assert_applies(base: dict[str, torch.Tensor], patched: dict[str, torch.Tensor],
                   names: dict[str, str], updates: dict[str, torch.Tensor], strength: float,
                   rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Each weight ComfyUI patched is its base plus `strength` x the update `updates` names
    for it (kohya name -> flattened update, computed by the caller); every other weight is
    unchanged."""
    assert set(updates) <= set(names), sorted(set(updates) - set(names))[:5]
    expected = {names[name]: update for name, update in updates.items()}
    assert len(expected) == len(updates)
    assert patched.keys() == base.keys()
    for key, weight in base.items():
        if key in expected:
            want = weight + strength * expected[key].reshape(weight.shape).to(weight.dtype)
            torch.testing.assert_close(patched[key], want, rtol=rtol, atol=atol, msg=key)
        else:
            assert torch.equal(patched[key], weight), key
