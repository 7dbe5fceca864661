"""Flux.2 Klein's files, checked before anything is written: a `Flux2KleinPipeline` diffusers
folder whose transformer takes what its text encoder gives (the 9B transformer reads Qwen3-8B,
the 4B Qwen3-4B: three stacked hidden layers), and the step-distilled Klein models named as
such and refused unless `model.train_distilled` says otherwise.

What marks a distilled Klein is data, read from the folder's `model_index.json`
(`DISTILLED_MARKERS`): Flux2KleinPipeline registers `is_distilled` in its config, the released
FLUX.2-klein-4B and -9B say `"is_distilled": true`, the base models leave it out (False).
ComfyUI's split files (the diffusion model, Qwen3 and the VAE, each its own `.safetensors`)
are recognised by their keys (`part_of`, from the header alone): a missing, swapped or wrong
file is refused naming the file, what it is and the field it belongs in, and a 9B diffusion
model beside Qwen3-4B (or the reverse) naming both. Three right files load (`load_split_files`),
each component from the configs of the diffusion model's size.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from modules.config.problems import Problem
from modules.models.split_files import check_parts

# model_index.json key -> the value that marks a step-distilled model
DISTILLED_MARKERS: dict[str, Any] = {"is_distilled": True}
# the hidden layers Flux2KleinPipeline stacks (text_encoder_out_layers' default): the
# transformer's caption features are len(...) x the encoder's width
STACKED_LAYERS = (9, 18, 27)
BASE_MODELS = ("black-forest-labs/FLUX.2-klein-base-4B", "black-forest-labs/FLUX.2-klein-base-9B")


def _read_json(path: Path) -> dict | None:
    """A JSON file's object, or None when it is missing or unreadable (the shared folder
    checks name those)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def distilled_reason(folder: Path) -> str | None:
    """Why the folder holds a step-distilled Klein, or None: a marker of `DISTILLED_MARKERS`
    in its model_index.json."""
    index = _read_json(folder / "model_index.json") or {}
    for key, value in DISTILLED_MARKERS.items():
        if index.get(key) == value:
            return f"{folder / 'model_index.json'} says {key}: {json.dumps(value)}"
    return None


def distilled_problems(model: Any) -> list[Problem]:
    """Refuse the step-distilled Klein unless model.train_distilled, saying what to train."""
    why = distilled_reason(Path(model.path))
    if why is None or model.train_distilled:
        return []
    return [Problem("model.path", "a Flux.2 Klein base model", repr(model.path),
                    f"this is a step-distilled Klein ({why}): training it breaks its "
                    "distillation (LoRAs come out blurred or off-subject). Train the base model "
                    f"({' or '.join(BASE_MODELS)}) and apply the LoRA to the distilled one "
                    "afterwards; set model.train_distilled=true to train it anyway")]


def width_problems(folder: Path) -> list[Problem]:
    """The transformer's caption width against the text encoder's: a 9B transformer with the
    4B encoder (or the reverse) is refused, naming both configs."""
    transformer = _read_json(folder / "transformer" / "config.json")
    encoder = _read_json(folder / "text_encoder" / "config.json")
    if transformer is None or encoder is None:
        return []  # the shared folder checks name a missing or unreadable config
    takes, hidden = transformer.get("joint_attention_dim"), encoder.get("hidden_size")
    if not isinstance(takes, int) or not isinstance(hidden, int):
        return [Problem("model.path", "a Flux.2 Klein folder", repr(str(folder)),
                        "its transformer/config.json has no joint_attention_dim or its "
                        "text_encoder/config.json no hidden_size")]
    if takes != len(STACKED_LAYERS) * hidden:
        return [Problem("model.path", "a Klein transformer and the text encoder it was trained "
                        "with", repr(str(folder)),
                        f"{folder / 'transformer' / 'config.json'} takes caption features of "
                        f"{takes} = {len(STACKED_LAYERS)} layers x {takes // len(STACKED_LAYERS)}"
                        f", but {folder / 'text_encoder' / 'config.json'} is {hidden} wide "
                        "(Klein 4B reads Qwen3-4B, 2560; 9B reads Qwen3-8B, 4096)")]
    return []


# what each of ComfyUI's three files is, and the field that names it
PART_LABELS = {"transformer": "a Flux.2 Klein diffusion model (Flux2Transformer2DModel)",
               "text_encoder": "a Qwen3 text encoder (Qwen3-4B for Klein 4B, Qwen3-8B for 9B)",
               "vae": "Flux.2's 32-channel VAE (AutoencoderKLFlux2)"}
ORIGINAL_PREFIX = "model.diffusion_model."  # some diffusion-model files carry it
# the Klein sizes by the caption width their diffusion model reads (3 x the encoder's width)
SIZES = {7680: "Klein 4B (reads Qwen3-4B)", 12288: "Klein 9B (reads Qwen3-8B)"}
ENCODERS = {2560: "Qwen3-4B", 4096: "Qwen3-8B"}
DIFFUSERS_FOLDER = ("give the diffusers folder (model_index.json, transformer/, text_encoder/, "
                    "tokenizer/, vae/, scheduler/): " + " or ".join(BASE_MODELS))


def caption_width(keys: dict[str, tuple[int, ...]]) -> int | None:
    """The caption width a Klein diffusion model's keys read (its `txt_in`, or diffusers'
    `context_embedder`), or None."""
    names = {k.removeprefix(ORIGINAL_PREFIX): shape for k, shape in keys.items()}
    shape = names.get("txt_in.weight") or names.get("context_embedder.weight")
    return shape[1] if shape and len(shape) == 2 else None


def encoder_width(keys: dict[str, tuple[int, ...]]) -> int | None:
    """A Qwen3 file's hidden size (its token embedding's width), or None."""
    shape = keys.get("model.embed_tokens.weight") or keys.get("embed_tokens.weight")
    return shape[1] if shape and len(shape) == 2 else None


def part_of(keys: dict[str, tuple[int, ...]]) -> tuple[str | None, str]:
    """(which Klein part the keys are, or None; what they are in words)."""
    names = {k.removeprefix(ORIGINAL_PREFIX) for k in keys}
    flux2 = {"double_stream_modulation_img.lin.weight", "double_stream_modulation_img.linear.weight"}
    if names & flux2 and (any(n.startswith(("double_blocks.", "transformer_blocks."))
                              for n in names)):
        width = caption_width(keys)
        if width == 15360:
            return None, "Flux.2 dev's diffusion model (Mistral-conditioned), not Klein's"
        return "transformer", SIZES.get(width or 0, f"{PART_LABELS['transformer']} reading "
                                                    f"{width}-wide captions")
    if "double_blocks.0.img_mod.lin.weight" in names:
        return None, "a Flux.1 diffusion model, not Flux.2 Klein's"
    if any(re.fullmatch(r"(model\.)?layers\.0\.self_attn\.q_norm\.weight", n) for n in names):
        width = encoder_width(keys)
        return "text_encoder", (f"{ENCODERS[width]}" if width in ENCODERS else
                                f"{PART_LABELS['text_encoder']}, {width} wide")
    conv_out = keys.get("encoder.conv_out.weight")
    if conv_out is not None and "decoder.conv_in.weight" in keys:
        if conv_out[0] == 64:  # mean and log-variance of 32 latent channels
            return "vae", PART_LABELS["vae"]
        return None, (f"a VAE of {conv_out[0] // 2} latent channels (Flux.1's or SD's), not "
                      "Flux.2's 32")
    if any(k.startswith("model.diffusion_model.input_blocks.") for k in keys):
        return None, "a Stable Diffusion checkpoint"
    if any("lora_" in k or ".lokr_" in k or ".hada_" in k for k in keys):
        return None, "a LoRA, not a model"
    return None, f"none of Klein's parts (first key: {next(iter(keys), 'none')!r})"


def split_file_problems(model: Any) -> list[Problem]:
    """ComfyUI's three files, each the part its field names, the diffusion model of the size
    the encoder fits, and a tokenizer named; every problem at once, before anything is
    written."""
    problems, read = check_parts(model, "Klein", PART_LABELS, part_of)
    widths = {part: caption_width(keys) if part == "transformer" else encoder_width(keys)
              for part, keys in read.items()}
    takes, hidden = widths.get("transformer"), widths.get("text_encoder")
    if takes and hidden and takes != len(STACKED_LAYERS) * hidden:
        problems.append(Problem(
            "model.text_encoder_path", "the text encoder the diffusion model was trained with",
            repr(model.text_encoder_path),
            f"{Path(model.path).name} reads captions {takes} wide = {len(STACKED_LAYERS)} "
            f"layers x {takes // len(STACKED_LAYERS)}, but {Path(model.text_encoder_path).name} "
            f"is {hidden} wide (Klein 4B reads Qwen3-4B, 2560; 9B reads Qwen3-8B, 4096)"))
    if model.path and not (model.tokenizer_path or model.config_path):
        problems.append(Problem("model.tokenizer_path", "a folder with Qwen3's tokenizer",
                                "''", "the files hold no tokenizer: name a Klein diffusers "
                                "folder (its tokenizer/) or a Qwen3 tokenizer folder"))
    return problems


def input_problems(model: Any, single_file: bool) -> list[Problem]:
    """What is wrong with Klein's files beyond the shared folder checks."""
    if single_file:
        return split_file_problems(model)
    return width_problems(Path(model.path)) + distilled_problems(model)


# --- ComfyUI's diffusion-model file: the BFL original layout --------------------------------
# diffusers name -> BFL name, for the parts that are a rename (diffusers'
# `convert_flux2_transformer_checkpoint_to_diffusers` reads the file; this is its inverse). A
# pattern's groups are the block index; RMS norms are `.scale` there, `.weight` here.
_DOUBLE = r"transformer_blocks\.(\d+)\."
_SINGLE = r"single_transformer_blocks\.(\d+)\."
BFL_RENAMES: tuple[tuple[str, str], ...] = (
    (r"time_guidance_embed\.timestep_embedder\.linear_1\.", "time_in.in_layer."),
    (r"time_guidance_embed\.timestep_embedder\.linear_2\.", "time_in.out_layer."),
    (r"time_guidance_embed\.guidance_embedder\.linear_1\.", "guidance_in.in_layer."),
    (r"time_guidance_embed\.guidance_embedder\.linear_2\.", "guidance_in.out_layer."),
    (r"(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)"
     r"\.linear\.", r"\1.lin."),
    (r"x_embedder\.", "img_in."), (r"context_embedder\.", "txt_in."),
    (r"proj_out\.", "final_layer.linear."),
    (r"norm_out\.linear\.", "final_layer.adaLN_modulation.1."),
    (_DOUBLE + r"attn\.norm_q\.weight", r"double_blocks.\1.img_attn.norm.query_norm.scale"),
    (_DOUBLE + r"attn\.norm_k\.weight", r"double_blocks.\1.img_attn.norm.key_norm.scale"),
    (_DOUBLE + r"attn\.norm_added_q\.weight", r"double_blocks.\1.txt_attn.norm.query_norm.scale"),
    (_DOUBLE + r"attn\.norm_added_k\.weight", r"double_blocks.\1.txt_attn.norm.key_norm.scale"),
    (_DOUBLE + r"attn\.to_out\.0\.", r"double_blocks.\1.img_attn.proj."),
    (_DOUBLE + r"attn\.to_add_out\.", r"double_blocks.\1.txt_attn.proj."),
    (_DOUBLE + r"ff\.linear_in\.", r"double_blocks.\1.img_mlp.0."),
    (_DOUBLE + r"ff\.linear_out\.", r"double_blocks.\1.img_mlp.2."),
    (_DOUBLE + r"ff_context\.linear_in\.", r"double_blocks.\1.txt_mlp.0."),
    (_DOUBLE + r"ff_context\.linear_out\.", r"double_blocks.\1.txt_mlp.2."),
    (_SINGLE + r"attn\.to_qkv_mlp_proj\.", r"single_blocks.\1.linear1."),
    (_SINGLE + r"attn\.to_out\.", r"single_blocks.\1.linear2."),
    (_SINGLE + r"attn\.norm_q\.weight", r"single_blocks.\1.norm.query_norm.scale"),
    (_SINGLE + r"attn\.norm_k\.weight", r"single_blocks.\1.norm.key_norm.scale"),
)
# q, k and v of each stream, fused in that order into one `qkv` projection in the BFL layout
BFL_FUSED = re.compile(_DOUBLE + r"attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)\.")
# the final layer's modulation is (shift, scale) in the BFL layout, (scale, shift) in diffusers'
HALVES_SWAPPED = "norm_out.linear."


def swap_halves(tensor: Any) -> Any:
    """The tensor with its two halves (dim 0) swapped: BFL's (shift, scale) to diffusers'
    (scale, shift) and back (its own inverse)."""
    import torch
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def original_key(key: str, rows: int) -> tuple[str, tuple[int, int] | None]:
    """Where a diffusers Flux2Transformer2DModel tensor is in the BFL layout: its key and, for
    q / k / v (fused into the stream's `qkv`, in that order), the rows of the fused tensor that
    are its own (`rows`: its own count). `norm_out.linear` is stored with its halves swapped
    (`denoiser_file_swapped`)."""
    if m := BFL_FUSED.match(key):
        text = m[2].startswith("add_")
        start = "qkv".index(m[2][4] if text else m[2][-1]) * rows
        stream = "txt" if text else "img"
        rest = key[m.end():]
        return f"double_blocks.{m[1]}.{stream}_attn.qkv.{rest}", (start, start + rows)
    for pattern, replacement in BFL_RENAMES:
        renamed, count = re.subn("^" + pattern, replacement, key)
        if count:
            return renamed, None
    return key, None


def stored_as(key: str) -> Any:
    """How a diffusers tensor's values are stored in the BFL file (None: as they are): the
    final modulation's halves swapped. Its own inverse."""
    return swap_halves if key.startswith(HALVES_SWAPPED) else None


def to_original_names(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A diffusers Flux2Transformer2DModel's weights in the BFL layout ComfyUI's diffusion-model
    files use: q / k / v fused into each stream's `qkv`, the final modulation's halves swapped,
    the rest renamed (`original_key`)."""
    import torch
    fused: dict[str, list[tuple[int, Any]]] = {}
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        name, rows = original_key(key, value.shape[0])
        swap = stored_as(key)
        value = swap(value) if swap else value
        if rows is None:
            out[name] = value
        else:
            fused.setdefault(name, []).append((rows[0], value))
    for name, parts in fused.items():
        out[name] = torch.cat([value for _, value in sorted(parts, key=lambda p: p[0])], dim=0)
    return out


def is_transformer_file(path: Path) -> bool:
    """Whether a .safetensors file is a lone Klein diffusion model (ComfyUI's kind)."""
    from modules.models.split_files import keys_of
    return part_of(keys_of(path))[0] == "transformer"


def save_transformer_file(transformer: Any, path: Path, metadata: dict[str, str] | None = None,
                          dtype: Any = None) -> Path:
    """The (fine-tuned) transformer as one diffusion-model file in the BFL layout, ComfyUI's
    `diffusion_models/` kind (what `Flux2Transformer2DModel.from_single_file` reads), written
    atomically."""
    from safetensors.torch import save_file

    from modules.models.precision import cast_for_saving
    from modules.models.single_file import _plain_state_dict
    from modules.util.atomic import atomic_file
    tensors = to_original_names(_plain_state_dict(transformer, "transformer"))
    tensors = cast_for_saving({k: v.contiguous() for k, v in tensors.items()}, dtype, str(path))
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata=dict(metadata or {}))
    return path


# --- ComfyUI's split files loaded -------------------------------------------------------------
# the configs shipped for each size (modules/models/configs), by the caption width the
# diffusion model reads
SIZE_CONFIGS = {7680: "klein4b", 12288: "klein9b"}
# Flux.2's VAE file (BFL's ae.safetensors): the ldm VAE names diffusers' AutoencoderKL maps
# (`single_file.vae_key_to_ldm`), its quant convs inside the encoder and decoder, and the
# batch norm of the latent statistics as it is
VAE_MOVED = (("quant_conv.", "encoder.quant_conv."), ("post_quant_conv.", "decoder.post_quant_conv."))


def vae_original_key(key: str, num_up_blocks: int) -> str:
    """Where an AutoencoderKLFlux2 tensor is in BFL's VAE file."""
    from modules.models.single_file import vae_key_to_ldm
    for ours, theirs in VAE_MOVED:
        if key.startswith(ours):
            return theirs + key[len(ours):]
    return vae_key_to_ldm(key, num_up_blocks)


def vae_to_original(vae: Any) -> dict[str, Any]:
    """An AutoencoderKLFlux2's tensors in BFL's layout (the mid attention's projections as
    1 x 1 convolutions, as the ldm layout holds them)."""
    num_up = len(vae.config.up_block_types)
    out = {}
    for key, value in vae.state_dict().items():
        name = vae_original_key(key, num_up)
        out[name] = value[:, :, None, None] if ".mid.attn_1." in name and value.ndim == 2 \
            else value
    return out


def vae_from_original(vae: Any, tensors: dict[str, Any], path: str) -> Any:
    """`vae` (an AutoencoderKLFlux2 built from its config) with BFL's VAE file's tensors;
    SingleFileError naming the first tensor the file lacks or holds in another shape. The
    batch norm's step count, which inference never reads, keeps its value when absent."""
    from modules.models.single_file import SingleFileError
    num_up = len(vae.config.up_block_types)
    state = vae.state_dict()
    loaded = {}
    for key, value in state.items():
        name = vae_original_key(key, num_up)
        if name not in tensors:
            if key.endswith("num_batches_tracked"):
                continue
            raise SingleFileError(f"{path}: has no {name} (the VAE's {key}): not Flux.2's "
                                  "VAE in BFL's layout")
        tensor = tensors[name]
        if tensor.numel() != value.numel():
            raise SingleFileError(f"{path}: {name} is {tuple(tensor.shape)}, but the VAE config "
                                  f"makes {key} {tuple(value.shape)}")
        loaded[key] = tensor.reshape(value.shape)
    vae.load_state_dict(loaded, strict=False)
    return vae


def size_configs(path: Path) -> str | None:
    """The shipped configs (under modules/models/configs) of a Klein diffusion-model file's
    size, by the caption width it reads; None for a file of neither size."""
    from modules.models.split_files import keys_of
    return SIZE_CONFIGS.get(caption_width(keys_of(path)) or 0)


def load_split_files(model: Any, config_folder: Path, dtypes: Any) -> dict[str, Any]:
    """The components from ComfyUI's three files, each built from `config_folder`'s configs:
    `load_split_rest`'s diffusion model and VAE, Qwen3 as Z-Image's; the tokenizer from
    model.tokenizer_path (or the config folder)."""
    from modules.models.split_files import load_split_text
    transformer, vae = load_split_rest(model, config_folder, dtypes)
    encoders, tokenizers = load_split_text(model, config_folder, dtypes)
    return {"transformer": transformer, "vae": vae, **encoders, **tokenizers}


def load_split_rest(model: Any, config_folder: Path, dtypes: Any) -> tuple[Any, Any]:
    """(diffusion model, VAE) of the split files: the diffusion model by diffusers' own BFL
    reader (Flux2Transformer2DModel.from_single_file), the VAE by `vae_from_original`."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from safetensors.torch import load_file

    from modules.models.bundle import dtype_of
    transformer = Flux2Transformer2DModel.from_single_file(
        model.path, config=str(config_folder), subfolder="transformer",
        torch_dtype=dtype_of(dtypes, "transformer"), local_files_only=True)
    vae = AutoencoderKLFlux2.from_config(
        AutoencoderKLFlux2.load_config(config_folder / "vae", local_files_only=True))
    # eval(), as from_pretrained leaves a model: a batch norm in train mode would move the
    # latent statistics at every encode
    vae = vae_from_original(vae, load_file(model.vae_path), model.vae_path).to(
        dtype_of(dtypes, "vae")).eval()
    return transformer, vae
