"""The Z-Image files users download for ComfyUI, in and out: the diffusion model, the Qwen3
text encoder and the VAE as three separate `.safetensors` files (ComfyUI's
`diffusion_models/`, `text_encoders/` and `vae/` folders), each recognised by its keys, a wrong
or missing one named before anything is written; the distilled Turbo model named as such;
and a fine-tuned transformer saved in the layout those files use.

The diffusion model's layout is the original Z-Image one (ComfyUI's NextDiT names): fused
`attention.qkv`, `attention.out`, `q_norm` / `k_norm`, `x_embedder`, `final_layer`; diffusers'
`convert_z_image_transformer_checkpoint_to_diffusers` reads it, and `to_original_names` below
is its inverse (the tests check the round trip, and ComfyUI's own detection, at full size).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from modules.config.problems import Problem
from modules.config.schema import ModelConfig
from modules.models.split_files import check_parts, keys_of

ORIGINAL_PREFIX = "model.diffusion_model."  # some files carry it; ComfyUI's split ones do not
# diffusers name -> original name, for the parts that are a rename
RENAMES = (("all_final_layer.2-1.", "final_layer."), ("all_x_embedder.2-1.", "x_embedder."),
           (".attention.to_out.0.", ".attention.out."),
           (".attention.norm_k.", ".attention.k_norm."),
           (".attention.norm_q.", ".attention.q_norm."))
# what a part is, by the keys it has (either naming: original or diffusers)
PART_LABELS = {"transformer": "a Z-Image diffusion model (ZImageTransformer2DModel)",
               "text_encoder": "a Qwen3 text encoder (Qwen3-4B for Z-Image)",
               "vae": "a 16-channel VAE (Flux.1's ae.safetensors, which Z-Image uses)"}
# Z-Image-Turbo is the step-distilled model; "de-turbo" names the de-distilled ones
TURBO_NAME = re.compile(r"turbo", re.IGNORECASE)
DE_DISTILLED_NAME = re.compile(r"de[-_ ]?turbo|de[-_ ]?distill", re.IGNORECASE)
TURBO_SHIFT = 3.0  # Turbo's scheduler shift; Base's is 6.0


def to_original_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers ZImageTransformer2DModel's weights under the original names (q, k, v
    fused into `attention.qkv`), as ComfyUI's diffusion-model files hold them."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if ".attention.to_k." in key or ".attention.to_v." in key:
            continue
        if ".attention.to_q." in key:
            parts = [state_dict[key.replace(".to_q.", f".to_{p}.")] for p in "qkv"]
            out[key.replace(".attention.to_q.", ".attention.qkv.")] = torch.cat(parts, dim=0)
            continue
        for old, new in RENAMES:
            key = key.replace(old, new)
        out[key] = value
    return out


def original_key(key: str, rows: int) -> tuple[str, tuple[int, int] | None]:
    """Where a diffusers ZImageTransformer2DModel tensor is in the original layout
    (`to_original_names`' naming): its key and, for q / k / v (fused into `attention.qkv`,
    in that order), the rows of the fused tensor that are its own (`rows`: its own count)."""
    for part in "qkv":
        if f".attention.to_{part}." in key:
            start = "qkv".index(part) * rows
            return key.replace(f".attention.to_{part}.", ".attention.qkv."), (start, start + rows)
    for old, new in RENAMES:
        key = key.replace(old, new)
    return key, None


def is_transformer_file(path: Path) -> bool:
    """Whether a .safetensors file is a lone Z-Image diffusion model (ComfyUI's kind)."""
    return part_of(keys_of(path))[0] == "transformer"


def part_of(keys: dict[str, tuple[int, ...]]) -> tuple[str | None, str]:
    """(which Z-Image part the keys are, or None; what they are in words)."""
    names = {k.removeprefix(ORIGINAL_PREFIX) for k in keys}
    if "cap_embedder.1.weight" in names and any(
            re.fullmatch(r"layers\.0\.attention\.(qkv|to_q)\.weight", n) for n in names):
        return "transformer", PART_LABELS["transformer"]
    if any(re.fullmatch(r"(model\.)?layers\.0\.self_attn\.q_norm\.weight", n) for n in names):
        return "text_encoder", PART_LABELS["text_encoder"]
    conv_out = keys.get("encoder.conv_out.weight")
    if conv_out is not None and "decoder.conv_in.weight" in keys:
        if conv_out[0] == 32:  # mean and log-variance of 16 latent channels
            return "vae", PART_LABELS["vae"]
        return None, f"a VAE of {conv_out[0] // 2} latent channels (SD's), not Z-Image's 16"
    if any(k.startswith("model.diffusion_model.input_blocks.") for k in keys):
        return None, "a Stable Diffusion checkpoint"
    if any("lora_" in k or ".lokr_" in k or ".hada_" in k for k in keys):
        return None, "a LoRA, not a model"
    if "layers.0.self_attn.q_proj.weight" in names or "model.layers.0.self_attn.q_proj.weight" in names:
        return None, "a language model without Qwen3's q_norm (Qwen2 or another)"
    return None, f"none of Z-Image's parts (first key: {next(iter(keys), 'none')!r})"


def split_file_problems(model: ModelConfig) -> list[Problem]:
    """Each of the three files there and the part its field names; every problem at once,
    each naming its file and what was expected, before anything is written."""
    problems, _read = check_parts(model, "Z-Image", PART_LABELS, part_of)
    if model.path and not (model.tokenizer_path or model.config_path):
        problems.append(Problem("model.tokenizer_path", "a folder with Qwen3's tokenizer",
                                "''", "the files hold no tokenizer: name a Z-Image diffusers "
                                "folder (its tokenizer/) or a Qwen3 tokenizer folder"))
    return problems


def distilled_reason(path: str) -> str | None:
    """Why the model at `path` is Z-Image-Turbo, the step-distilled model, or None: its
    file or folder name, or a diffusers folder's scheduler shift (Turbo's 3.0; Base's 6.0)."""
    p = Path(path)
    if TURBO_NAME.search(p.name) and not DE_DISTILLED_NAME.search(p.name):
        return f"its name ({p.name}) says Turbo"
    scheduler = p / "scheduler" / "scheduler_config.json"
    if p.is_dir() and scheduler.is_file():
        try:
            shift = json.loads(scheduler.read_text(encoding="utf-8")).get("shift")
        except (OSError, ValueError):
            return None
        if shift == TURBO_SHIFT:
            return f"its scheduler's shift is {TURBO_SHIFT:g}, Z-Image-Turbo's (Base's is 6)"
    return None


def distilled_problems(model: ModelConfig) -> list[Problem]:
    """Refuse to train the distilled Turbo model unless asked, saying what to do instead."""
    why = distilled_reason(model.path)
    if why is None or model.train_distilled:
        return []
    return [Problem("model.path", "Z-Image (Base), or a de-distilled Z-Image", repr(model.path),
                    f"this is Z-Image-Turbo ({why}): a step-distilled model, whose "
                    "distillation training breaks down (LoRAs come out blurred or off-subject). "
                    "Train Z-Image Base (Tongyi-MAI/Z-Image), or a de-distilled Turbo (e.g. "
                    "ostris' Z-Image-De-Turbo) and apply the LoRA to Turbo afterwards; set "
                    "model.train_distilled=true to train Turbo anyway (for example with a "
                    "de-distillation training adapter merged into its weights)")]


def load_split_files(model: ModelConfig, config_folder: Path, dtypes) -> dict:
    """The components from the three files, each built from `config_folder`'s configs (the
    shipped ones, or model.config_path), and the tokenizer from model.tokenizer_path."""
    from modules.models.split_files import load_split_text
    transformer, vae = load_split_rest(model, config_folder, dtypes)
    encoders, tokenizers = load_split_text(model, config_folder, dtypes)
    return {"transformer": transformer, "vae": vae, **encoders, **tokenizers}


def load_split_rest(model: ModelConfig, config_folder: Path, dtypes) -> tuple:
    """(diffusion model, VAE) of the three files, by diffusers' own single-file readers."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel

    from modules.models.bundle import dtype_of
    local = {"local_files_only": True}
    transformer = ZImageTransformer2DModel.from_single_file(
        model.path, config=str(config_folder), subfolder="transformer",
        torch_dtype=dtype_of(dtypes, "transformer"), **local)
    vae = AutoencoderKL.from_single_file(model.vae_path, config=str(config_folder),
                                         subfolder="vae", torch_dtype=dtype_of(dtypes, "vae"),
                                         **local)
    return transformer, vae


def save_transformer_file(transformer: torch.nn.Module, path: Path,
                          metadata: dict[str, str] | None = None,
                          dtype: torch.dtype | None = None) -> Path:
    """The (fine-tuned) transformer as one diffusion-model file in the original layout,
    ComfyUI's `diffusion_models/` kind, written atomically."""
    from safetensors.torch import save_file

    from modules.models.precision import cast_for_saving
    from modules.models.single_file import _plain_state_dict
    from modules.util.atomic import atomic_file
    tensors = to_original_names(_plain_state_dict(transformer, "transformer"))
    tensors = cast_for_saving({k: v.contiguous() for k, v in tensors.items()}, dtype, str(path))
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata=dict(metadata or {}))
    return path
