"""Single-file checkpoints: the original SD / SDXL (ldm) layout that A1111, ComfyUI and Forge use.

Loading goes through diffusers' `from_single_file` with configs that ship with Tempera
(`configs/<type>/`), so no network access is needed. Saving converts diffusers' key names back
to the ldm layout with the tables below: the inverse of diffusers' `convert_ldm_unet_checkpoint`,
`convert_ldm_vae_checkpoint`, `convert_ldm_clip_checkpoint` and `convert_open_clip_checkpoint`
(diffusers/loaders/single_file_utils.py), which the tests use to check the round trip.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from modules.config.schema import ModelType
from modules.model_types import MODEL_TYPES
from modules.models.bundle import PREDICTION_TYPES, Dtypes, ModelBundle, dtype_of, widest_dtype
from modules.models.families.base import FileConventions
from modules.models.folder import PICKLE_SUFFIXES, SAFETENSORS_SUFFIX
from modules.models.precision import cast_for_saving
from modules.util.atomic import atomic_file
from modules.util.errors import first_line

CONFIGS_DIR = Path(__file__).parent / "configs"
LDM_UNET_PREFIX = "model.diffusion_model."
LDM_VAE_PREFIX = "first_stage_model."

# Keys whose presence identifies each family (checked in this order: SDXL files also hold
# `conditioner.*`, never `cond_stage_model.*`).
DETECTION_PREFIXES: tuple[tuple[ModelType, str, str], ...] = (
    (ModelType.SDXL, "conditioner.embedders.1.model.", "OpenCLIP ViT-bigG as second encoder"),
    (ModelType.SD2, "cond_stage_model.model.", "OpenCLIP ViT-H text encoder"),
    (ModelType.SD15, "cond_stage_model.transformer.", "CLIP ViT-L text encoder"),
)

# --- diffusers -> ldm name tables -------------------------------------------------------
UNET_FIXED = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
              "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
              "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}
UNET_RESNET_PARTS = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0",
                     "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1",
                     "conv_shortcut": "skip_connection"}
VAE_FIXED = {"encoder.conv_norm_out": "encoder.norm_out",
             "decoder.conv_norm_out": "decoder.norm_out"}
VAE_RESNET_PARTS = {"conv_shortcut": "nin_shortcut"}
VAE_ATTENTION_PARTS = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v",
                       "to_out.0": "proj_out"}
OPEN_CLIP_FIXED = {"embeddings.token_embedding.weight": "token_embedding.weight",
                   "embeddings.position_embedding.weight": "positional_embedding",
                   "final_layer_norm.weight": "ln_final.weight",
                   "final_layer_norm.bias": "ln_final.bias"}
OPEN_CLIP_LAYER_PARTS = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc",
                         "mlp.fc2": "mlp.c_proj", "self_attn.out_proj": "attn.out_proj"}


class SingleFileError(ValueError):
    """A single-file checkpoint that cannot be used, with the reason and what to do."""


# --- detection and loading --------------------------------------------------------------
def config_folder_for(files: FileConventions, path: str | Path | None = None) -> Path:
    """The diffusers config folder shipped with Tempera for a family's single files (no
    weights); for a family of several sizes, the size of the single file at `path`."""
    size = (files.single_file_sizes(Path(path)) if files.single_file_sizes and path
            and Path(path).is_file() else None)
    return CONFIGS_DIR / (size or files.single_file_configs)


def is_single_file(path: str | Path) -> bool:
    """Whether a model path names a single checkpoint file (rather than a diffusers folder)."""
    path = Path(path)
    return path.suffix.lower() in (SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES) and not path.is_dir()


def check_format(path: Path, allow_pickle: bool) -> None:
    """Refuse pickle checkpoints unless opted in, and anything that is not a checkpoint file."""
    suffix = path.suffix.lower()
    if not path.is_file():
        raise SingleFileError(f"{path}: no such checkpoint file")
    if suffix in PICKLE_SUFFIXES and not allow_pickle:
        raise SingleFileError(
            f"{path}: '{suffix}' files are Python pickles, and unpickling a file can run arbitrary "
            "code hidden in it. Convert it to .safetensors (e.g. with a trusted tool), or opt in "
            "to loading pickles; Tempera then loads them with torch.load(weights_only=True), "
            "which refuses anything but tensors.")
    if suffix not in PICKLE_SUFFIXES and suffix != SAFETENSORS_SUFFIX:
        raise SingleFileError(f"{path}: unknown checkpoint extension '{suffix}'; expected "
                              f"{SAFETENSORS_SUFFIX} or one of {', '.join(PICKLE_SUFFIXES)}")


def checkpoint_keys(path: Path, allow_pickle: bool = False) -> list[str]:
    """The tensor names of a checkpoint, read without loading safetensors' tensors."""
    check_format(path, allow_pickle)
    if path.suffix.lower() == SAFETENSORS_SUFFIX:
        from safetensors import safe_open
        try:
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        except Exception as exc:  # safetensors raises its own error type for a damaged header
            raise SingleFileError(f"{path}: not a readable .safetensors file "
                                  f"({first_line(exc)});"
                                  " the download may be incomplete") from exc
    return list(load_pickle_checkpoint(path))


# ComfyUI's marker keys in a checkpoint: it predicts v; its schedule has zero terminal SNR
SCHEDULE_MARKERS = ("v_pred", "ztsnr")


def schedule_markers(path: str | Path) -> set[str]:
    """Which `SCHEDULE_MARKERS` a .safetensors checkpoint carries (its header only; other
    files and folders carry none that are read)."""
    path = Path(path)
    if not is_single_file(path) or path.suffix.lower() != SAFETENSORS_SUFFIX:
        return set()
    return set(checkpoint_keys(path)) & set(SCHEDULE_MARKERS)


def load_pickle_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A pickle checkpoint's tensors, loaded with `weights_only=True` (no code is run)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors come in many types; all mean "cannot use it"
        raise SingleFileError(f"{path}: cannot be loaded with weights_only=True: "
                              f"{first_line(exc)}") from exc
    while isinstance(checkpoint, dict) and "state_dict" in checkpoint:
        checkpoint = checkpoint["state_dict"]  # Lightning-style checkpoints nest the weights
    if not isinstance(checkpoint, dict):
        raise SingleFileError(f"{path}: holds a {type(checkpoint).__name__}, not a state dict")
    return checkpoint


def detect_model_type(path: str | Path, expected: ModelType | None = None,
                      allow_pickle: bool = False) -> ModelType:
    """Which SD family a single-file checkpoint is, from its key names.

    Raises SingleFileError when the file is not a full SD checkpoint (e.g. a LoRA, a lone UNet,
    a diffusers component) or when it is another family than `expected`.
    """
    path = Path(path)
    keys = checkpoint_keys(path, allow_pickle)
    if not any(k.startswith(LDM_UNET_PREFIX) for k in keys):
        raise SingleFileError(f"{path}: not a Stable Diffusion checkpoint: {_what_is_it(keys)}")
    found = next((t for t, prefix, _ in DETECTION_PREFIXES
                  if any(k.startswith(prefix) for k in keys)), None)
    if found is None:
        raise SingleFileError(
            f"{path}: has a UNet but no text encoder Tempera knows "
            "('conditioner.embedders.1.model.' for SDXL, 'cond_stage_model.model.' for SD 2, "
            "'cond_stage_model.transformer.' for "
            "SD 1.x); an SDXL refiner or a UNet-only file cannot be trained here")
    if expected is not None and found != expected:
        why = next(desc for t, _, desc in DETECTION_PREFIXES if t == found)
        raise SingleFileError(
            f"{path}: is a {MODEL_TYPES[found].label} checkpoint ({why}), but model.type is "
            f"{expected.value}; set model.type={found.value}")
    return found


def _what_is_it(keys: list[str]) -> str:
    if not keys:
        return "the file holds no tensors"
    if any(k.startswith(("lora_unet_", "lora_te", "unet.", "text_encoder.")) for k in keys):
        return "it looks like a LoRA; load it on top of a base model instead"
    if any(k.startswith(("down_blocks.", "encoder.down_blocks.", "text_model.")) for k in keys):
        return "it looks like a single diffusers component, not a whole model"
    return f"no 'model.diffusion_model.*' keys (first key: {keys[0]!r})"


def find_tokenizer_folder(checkpoint: Path, model_type: ModelType,
                          tokenizer_folder: Path | None = None) -> Path:
    """A folder with the model type's tokenizer subfolders (`tokenizer/`, SDXL: `tokenizer_2/`).

    CLIP's vocabulary (~50k tokens) is not in single-file checkpoints and Tempera cannot
    download it, so it comes from `tokenizer_folder` or from next to the checkpoint.
    """
    names = MODEL_TYPES[model_type].tokenizers
    candidates = [tokenizer_folder] if tokenizer_folder else [checkpoint.parent]
    for folder in candidates:
        if all(_has_tokenizer(Path(folder) / n) for n in names):
            return Path(folder)
    where = tokenizer_folder or checkpoint.parent
    raise SingleFileError(
        f"{checkpoint}: no CLIP tokenizer found in {where} (looked for "
        f"{', '.join(n + '/' for n in names)} with vocab.json + merges.txt or tokenizer.json). "
        "Single-file checkpoints do not contain the tokenizer. Point the tokenizer folder at any "
        f"diffusers folder of the same family ({MODEL_TYPES[model_type].label}), or copy its "
        "tokenizer folders next to the checkpoint. See modules/models/configs/README.md.")


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (
        (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())


def load_single_file(path: str | Path, model_type: ModelType, *, config_folder: str | Path,
                     dtype: torch.dtype = torch.float32, allow_pickle: bool = False,
                     tokenizer_folder: str | Path | None = None) -> dict[str, Any]:
    """The components (unet, vae, text encoder(s), tokenizer(s), scheduler) of a checkpoint file.

    `config_folder`: the architecture configs, the family's shipped one (`config_folder_for`)
    or, in the tests, a tiny model's folder. Pickles are read with `weights_only=True` (diffusers does the same).
    """
    import diffusers
    from transformers import AutoTokenizer

    path = Path(path)
    detect_model_type(path, expected=model_type, allow_pickle=allow_pickle)
    config = Path(config_folder)
    spec = MODEL_TYPES[model_type]
    kwargs: dict[str, Any] = {}
    if not all(_has_tokenizer(config / n) for n in spec.tokenizers):
        folder = find_tokenizer_folder(path, model_type,
                                       Path(tokenizer_folder) if tokenizer_folder else None)
        for name in spec.tokenizers:
            kwargs[name] = AutoTokenizer.from_pretrained(folder / name, local_files_only=True)
    pipeline_cls = getattr(diffusers, spec.pipeline_class)
    pipe = pipeline_cls.from_single_file(str(path), config=str(config), local_files_only=True,
                                         torch_dtype=dtype, **kwargs)
    wanted = ("unet", "vae", "scheduler", *spec.text_encoders, *spec.tokenizers)
    parts = {name: pipe.components[name] for name in wanted}
    _check_all_loaded(path, parts)
    return parts


def _check_all_loaded(path: Path, parts: dict[str, Any]) -> None:
    """Raise when diffusers left weights unset (on the meta device) instead of failing itself.

    diffusers tells SDXL's two encoders apart by width; when a checkpoint's keys do not match
    the config (e.g. two equally wide encoders), it leaves the second one unloaded.
    """
    for name, part in parts.items():
        if isinstance(part, torch.nn.Module):
            missing = [k for k, v in part.state_dict().items() if v.is_meta]
            if missing:
                raise SingleFileError(f"{path}: {name} was not fully loaded from the checkpoint "
                                      f"({len(missing)} tensors missing, e.g. {missing[0]!r}); "
                                      "its keys or shapes do not match the config")


def load_single_file_bundle(path: str | Path, model_type: ModelType, prediction_type, *,
                            config_folder: str | Path, dtype: Dtypes = torch.float32,
                            allow_pickle: bool = False,
                            tokenizer_folder: str | Path | None = None) -> ModelBundle:
    """A `ModelBundle` from a checkpoint file, like `loader.load_model` gives for a folder.

    ``dtype`` is one dtype or one per component: the file is read once at the most precise of
    them and each component is then rounded once to its own.
    """
    from diffusers import DDPMScheduler

    from modules.config.schema import PredictionType

    parts = load_single_file(path, model_type, config_folder=config_folder,
                             dtype=widest_dtype(dtype), allow_pickle=allow_pickle,
                             tokenizer_folder=tokenizer_folder)
    spec = MODEL_TYPES[model_type]
    for name in ("unet", "vae", *spec.text_encoders):
        parts[name].to(dtype=dtype_of(dtype, name))
    scheduler = DDPMScheduler.from_config(parts["scheduler"].config)
    if prediction_type != PredictionType.AUTO:
        scheduler.register_to_config(prediction_type=PREDICTION_TYPES[prediction_type])
    elif "v_pred" in schedule_markers(path):  # AUTO: the file says it predicts v
        scheduler.register_to_config(prediction_type="v_prediction")
    return ModelBundle(model_type, Path(path), parts["unet"], parts["vae"],
                       {n: parts[n] for n in spec.text_encoders},
                       {n: parts[n] for n in spec.tokenizers}, scheduler)


# --- diffusers -> ldm conversion --------------------------------------------------------
def unet_key_to_ldm(key: str, config: Any) -> str:
    """The ldm name of a diffusers UNet parameter or module path (e.g. a LoRA target).

    ldm numbers the UNet's blocks flat: input_blocks 0 is conv_in, then each down level has
    `layers_per_block` (resnet[, attention]) blocks and one downsampler; each up level has
    `layers_per_block + 1` blocks, the last carrying the upsampler.
    """
    per = _layers_per_block(config)
    for diffusers_name, ldm_name in UNET_FIXED.items():
        if key == diffusers_name or key.startswith(diffusers_name + "."):
            return ldm_name + key[len(diffusers_name):]
    if m := re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)(.*)", key):
        block, kind, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
        return _unet_inner(f"input_blocks.{1 + block * (per + 1) + layer}", kind, rest)
    if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv(.*)", key):
        return f"input_blocks.{(int(m[1]) + 1) * (per + 1)}.0.op{m[2]}"
    if m := re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)(.*)", key):
        kind, index, rest = m[1], int(m[2]), m[3]
        return _unet_inner(f"middle_block.{1 if kind == 'attentions' else 2 * index}", kind, rest,
                           in_block=False)
    if m := re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)(.*)", key):
        block, kind, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
        return _unet_inner(f"output_blocks.{block * (per + 1) + layer}", kind, rest)
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv(.*)", key):
        block = int(m[1])
        slot = 2 if "CrossAttn" in config["up_block_types"][block] else 1
        return f"output_blocks.{block * (per + 1) + per}.{slot}.conv{m[2]}"
    raise SingleFileError(f"UNet key {key!r} has no ldm equivalent Tempera knows")


def _unet_inner(block: str, kind: str, rest: str, in_block: bool = True) -> str:
    if kind == "attentions":
        return f"{block}{'.1' if in_block else ''}{rest}"
    prefix = f"{block}.0" if in_block else block
    part, _, tail = rest.lstrip(".").partition(".")
    mapped = UNET_RESNET_PARTS.get(part, part)
    return f"{prefix}.{mapped}" + (f".{tail}" if tail else "")


def _layers_per_block(config: Any) -> int:
    per = config["layers_per_block"]
    if not isinstance(per, int):
        raise SingleFileError(f"per-level layers_per_block {per} has no ldm layout")
    return per


def vae_key_to_ldm(key: str, num_up_blocks: int) -> str:
    """The ldm name of a diffusers AutoencoderKL parameter (decoder levels run in reverse)."""
    for diffusers_name, ldm_name in VAE_FIXED.items():
        if key.startswith(diffusers_name + "."):
            return ldm_name + key[len(diffusers_name):]
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)", key):
        return f"{m[1]}.mid.block_{int(m[2]) + 1}.{_rename_head(m[3], VAE_RESNET_PARTS)}"
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)", key):
        return f"{m[1]}.mid.attn_1.{_rename_head(m[2], VAE_ATTENTION_PARTS)}"
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", key):
        return f"encoder.down.{m[1]}.block.{m[2]}.{_rename_head(m[3], VAE_RESNET_PARTS)}"
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", key):
        return f"encoder.down.{m[1]}.downsample.conv.{m[2]}"
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", key):
        level = num_up_blocks - 1 - int(m[1])
        return f"decoder.up.{level}.block.{m[2]}.{_rename_head(m[3], VAE_RESNET_PARTS)}"
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", key):
        return f"decoder.up.{num_up_blocks - 1 - int(m[1])}.upsample.conv.{m[2]}"
    return key  # conv_in/conv_out, quant_conv, post_quant_conv keep their names


def _rename_head(rest: str, table: dict[str, str]) -> str:
    for old, new in table.items():
        if rest.startswith(old + "."):
            return new + rest[len(old):]
    return rest


def clip_key_with_text_model(key: str) -> str:
    """A CLIP text encoder key as `CLIPTextModel` named it before transformers 5.6 flattened it.

    Checkpoints and LoRA tools all use the `text_model.` form.
    """
    if key.startswith(("text_model.", "text_projection.")):
        return key
    return "text_model." + key


def rename_weight_keys(folder: Path, rename) -> None:
    """Rename every tensor in a component folder's safetensors file(s), and the shard index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {rename(k): f.get_tensor(k) for k in f.keys()}
        save_file(tensors, str(path), metadata=metadata)
    for index in folder.glob("*.safetensors.index.json"):
        data = json.loads(index.read_text(encoding="utf-8"))
        data["weight_map"] = {rename(k): v for k, v in data.get("weight_map", {}).items()}
        index.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def open_clip_to_ldm(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers CLIP text encoder's weights in OpenCLIP's layout (fused q/k/v, ln_*)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        key = clip_key_with_text_model(key).removeprefix("text_model.")
        if key == "text_projection.weight":
            out["text_projection"] = value.T.contiguous()  # OpenCLIP multiplies x @ projection
        elif key in OPEN_CLIP_FIXED:
            out[OPEN_CLIP_FIXED[key]] = value
        elif m := re.fullmatch(r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(\w+)", key):
            qkv.setdefault(f"transformer.resblocks.{m[1]}.attn.in_proj_{m[3]}", {})[m[2]] = value
        elif m := re.fullmatch(r"encoder\.layers\.(\d+)\.(.*)", key):
            out[f"transformer.resblocks.{m[1]}.{_rename_head(m[2], OPEN_CLIP_LAYER_PARTS)}"] = value
        else:
            raise SingleFileError(f"text encoder key {key!r} has no OpenCLIP equivalent")
    for key, parts in qkv.items():
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


def to_ldm_state_dict(components: dict[str, Any], files: FileConventions
                      ) -> dict[str, torch.Tensor]:
    """The whole model's weights under the original SD / SDXL checkpoint names (`files`: the
    family's, which says where each text encoder goes)."""
    out: dict[str, torch.Tensor] = {}
    unet, vae = components["unet"], components["vae"]
    for key, value in _plain_state_dict(unet, "unet").items():
        out[LDM_UNET_PREFIX + unet_key_to_ldm(key, unet.config)] = value
    num_up = len(vae.config["up_block_types"])
    for key, value in _plain_state_dict(vae, "vae").items():
        ldm_key = vae_key_to_ldm(key, num_up)
        if ".mid.attn_1." in ldm_key and value.ndim == 2:
            value = value[:, :, None, None]  # ldm's VAE attention uses 1x1 convolutions
        out[LDM_VAE_PREFIX + ldm_key] = value
    # where each text encoder lives in an ldm checkpoint, and in which layout: "hf" keeps the
    # transformers names (CLIP ViT-L), "open_clip" is OpenCLIP's (SD 2's ViT-H, SDXL's bigG)
    for name, (prefix, layout) in files.single_file_text_encoders.items():
        weights = _plain_state_dict(components[name], name)
        if layout == "open_clip":
            converted = open_clip_to_ldm(weights)
        else:
            converted = {clip_key_with_text_model(k): v for k, v in weights.items()}
        out.update({prefix + k: v for k, v in converted.items()})
    return out


def _plain_state_dict(module: torch.nn.Module, name: str) -> dict[str, torch.Tensor]:
    state = module.state_dict()
    if any("lora_" in k or ".base_layer." in k for k in state):
        raise SingleFileError(
            f"{name} carries LoRA adapters; a single-file checkpoint holds plain weights. Save the "
            "LoRA on its own (DIFFUSERS or KOHYA format), or merge it into the weights first.")
    return state


def save_single_file(components: dict[str, Any], path: str | Path, files: FileConventions,
                     metadata: dict[str, str] | None = None,
                     dtype: torch.dtype | None = None) -> Path:
    """Write the full model as one ldm-layout .safetensors (what A1111/ComfyUI load), atomically.

    `components` holds unet, vae and the text encoder(s) by their pipeline names (`files`:
    the family's conventions, `family_files(model_type)`, say where each encoder goes); a
    `scheduler` predicting v adds ComfyUI's `v_pred` marker key, one rescaled for zero
    terminal SNR its `ztsnr` key.
    """
    from safetensors.torch import save_file

    path = Path(path)
    if path.suffix.lower() != SAFETENSORS_SUFFIX:
        raise SingleFileError(f"{path}: single-file checkpoints are saved as {SAFETENSORS_SUFFIX}")
    tensors = to_ldm_state_dict(components, files)
    tensors = cast_for_saving(tensors, dtype, str(path))
    scheduler = components.get("scheduler")
    if scheduler is not None and scheduler.config.get("prediction_type") == "v_prediction":
        tensors["v_pred"] = torch.zeros(0)
    if scheduler is not None and scheduler.config.get("rescale_betas_zero_snr"):
        tensors["ztsnr"] = torch.zeros(0)  # ComfyUI's marker of a zero-terminal-SNR schedule
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata=dict(metadata or {}))
    return path
