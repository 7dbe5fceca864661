"""What a LoRA tool needs to know of a base model without loading its weights: its family, the
Linear / Conv2d layers of the denoiser (a UNet, Z-Image's transformer: the class its family
record names) and text encoders (built on the meta device from the configs)
with their weight shapes, the kohya name of each, and where each layer's weight sits in the
base's files (a diffusers folder's component files, or an ldm single file's keys).

Layers are named canonically as (component, module path), the path as diffusers names a UNet
module and as checkpoints name a CLIP module (`text_model.encoder.layers.0.self_attn.q_proj`).
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modules.config.schema import ModelType
from modules.lora_tools.errors import LoraToolError, input_error
from modules.model_types import BUILTIN_PREFIX, MODEL_TYPES
from modules.models.families import family_files, family_of
from modules.models.folder import SAFETENSORS_SUFFIX
from modules.models.kohya import (KohyaError, fused_rows, kohya_module_name, original_layer,
                                  unfused_module_name)
from modules.models.single_file import (
    LDM_UNET_PREFIX, OPEN_CLIP_LAYER_PARTS, SingleFileError, _rename_head, clip_key_with_text_model,
    config_folder_for, detect_model_type, unet_key_to_ldm)

LayerKey = tuple[str, str]  # (component, module path)


@dataclass(frozen=True)
class Location:
    """Where one layer's weight is stored: a file, a tensor key and, for a q/k/v projection
    fused into OpenCLIP's `in_proj_weight`, the rows that belong to it."""
    file: Path
    key: str
    rows: tuple[int, int] | None = None
    # the file's values rearranged (its own inverse: Flux's final modulation, halves swapped)
    stored: Callable[[torch.Tensor], torch.Tensor] | None = None

    def read(self, stored: torch.Tensor) -> torch.Tensor:
        """The layer's weight, as diffusers holds it, from the stored tensor."""
        weight = stored[slice(*self.rows) if self.rows else slice(None)]
        return self.stored(weight) if self.stored else weight


@dataclass
class ModelLayout:
    """A base model's layers (by canonical key: weight shape) and its files."""
    model_type: ModelType
    source: str  # what it was read from, for messages
    shapes: dict[LayerKey, tuple[int, ...]]
    unet_config: Any
    path: Path | None = None  # the base's folder or single file; None: the shipped configs
    configs: Path | None = None  # the folder its architecture was read from
    kohya_names: dict[str, LayerKey] = field(default_factory=dict)
    # a layout that fuses layers (Klein's q / k / v into `qkv`): the fused kohya names with
    # their weight's rows, and each fused layer's rows in it
    fused_rows: dict[str, int] = field(default_factory=dict)
    fused_parts: dict[LayerKey, tuple[int, int]] = field(default_factory=dict)
    _file_shapes: dict[str, tuple[int, ...]] | None = field(default=None, repr=False)

    def kohya_name(self, key: LayerKey) -> str:
        return kohya_module_name(key[0], key[1], self.model_type, self.unet_config)

    @property
    def is_single_file(self) -> bool:
        return self.path is not None and self.path.is_file()

    @property
    def denoiser(self) -> str:
        """The denoiser's component name ("unet", "transformer")."""
        return MODEL_TYPES[self.model_type].denoiser

    def file_shapes(self) -> dict[str, tuple[int, ...]]:
        """A single-file base's tensor names and shapes (its header, read once)."""
        if self._file_shapes is None:
            from modules.lora_tools.streaming import read_header
            assert self.path is not None
            self._file_shapes = {k: tuple(v["shape"]) for k, v in read_header(self.path)[0].items()
                                 if k != "__metadata__"}
        return self._file_shapes


def _type_of_folder(folder: Path) -> ModelType:
    """The family of a diffusers folder: its pipeline class (each family's in MODEL_TYPES);
    SD 1.x and 2.x share theirs and differ in the text encoder."""
    index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    found = [t for t, spec in MODEL_TYPES.items() if spec.pipeline_class == index.get("_class_name")]
    if not found:
        raise LoraToolError(f"{folder}: a {index.get('_class_name')} folder, which no family "
                            f"these tools know uses ({', '.join(t.value for t in MODEL_TYPES)})")
    identify = family_of(found[0]).identify_folder
    if len(found) == 1 or identify is None:
        return found[0]
    # several families share the pipeline class: the one the folder holds is theirs to say
    # (the kohya and diffusers names of those families are the same; only metadata differs)
    return identify(folder)[0]


def _same_names(a: ModelType, b: ModelType) -> bool:
    """Whether two families name the same layers: those sharing a pipeline class do (SD 1.x
    and 2.x: one LoRA layout)."""
    return a == b or MODEL_TYPES[a].pipeline_class == MODEL_TYPES[b].pipeline_class


def check_family(source: str, found: ModelType, wanted: ModelType | None,
                 which: str = "base") -> None:
    """Refuse a model of another family than `wanted`: the base's given as the model type,
    or the tuned model's given by the base."""
    if wanted is not None and not _same_names(found, wanted):
        said = "as {model_type} says" if which == "base" else "as the {base} is"
        raise input_error("{" + which + "} {source}: is {found_label} ({found}), not {label} "
                          "({wanted}) " + said, source=source,
                          found_label=MODEL_TYPES[found].label, found=found.value,
                          label=MODEL_TYPES[wanted].label, wanted=wanted.value)


def _denoiser_file_family(path: Path) -> ModelType | None:
    """The family whose lone denoiser file `path` is (ComfyUI's diffusion-model file), if any."""
    for model_type in MODEL_TYPES:
        files = family_of(model_type).files
        if files is not None and files.denoiser_file is not None and files.denoiser_file(path):
            return model_type
    return None


def _about(which: str, rest: str, **values: object) -> LoraToolError:
    """An error about the model input `which` ("base" or "tuned"), named first."""
    return input_error("{" + which + "} " + rest, **values)


def resolve_builtin(name: str, cache_dir: Path, which: str = "base") -> Path:
    """The folder of a built-in tiny model (`builtin:tiny-sd15`), built into `cache_dir` on
    first use, as training resolves it (`modules.models.loader.resolve_model_path`)."""
    from modules.models.loader import resolve_model_path
    from modules.models.tiny import BUILTIN_MODELS
    if name not in BUILTIN_MODELS:
        raise _about(which, "{name!r}: no such built-in model; the built-in ones are {known}",
                     name=name, known=", ".join(BUILTIN_MODELS))
    return resolve_model_path(name, cache_dir)


def model_layout(path: str | Path | None = None, model_type: ModelType | None = None,
                 config_folder: str | Path | None = None, cache_dir: Path | None = None,
                 which: str = "base") -> ModelLayout:
    """The layout of a base: a diffusers folder, a `.safetensors` single file (an ldm
    checkpoint, or a family's lone denoiser file such as Z-Image's ComfyUI diffusion model;
    its configs from `config_folder` or the family's shipped ones), a built-in tiny model
    (`builtin:…`, built into `cache_dir`), or, with no path, the shipped architecture of
    `model_type` (enough to name layers, e.g. to convert a kohya file). `which` is the input
    the path came from ("base" or "tuned"), named in errors about it."""
    if path is None:
        if model_type is None:
            raise input_error("{base} or {model_type} is needed to know the layers' names")
        configs = config_folder_for(family_files(model_type))
        return _layout(model_type, Path(config_folder or configs), None, f"{model_type.value}")
    source = str(path)
    if source.startswith(BUILTIN_PREFIX):
        if cache_dir is None:
            raise _about(which, "{name}: a built-in model needs the cache folder to build it in",
                         name=source)
        path = resolve_builtin(source, cache_dir, which)
    path = Path(path)
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise _about(which, "{path}: not a diffusers model folder (no model_index.json)",
                         path=path)
        found = _type_of_folder(path)
        check_family(source, found, model_type, which)
        return _layout(model_type or found, path, path, source)
    if not path.is_file():
        raise _about(which, "{path}: no such model folder or file", path=path)
    if path.suffix.lower() != SAFETENSORS_SUFFIX:
        raise _about(which, "{path}: only .safetensors checkpoints are read (a pickle can run "
                     "code when loaded); convert it to .safetensors first", path=path)
    try:
        lone = _denoiser_file_family(path)
    except Exception as error:  # safetensors has its own error types for a damaged file
        raise _about(which, "{path}: not a readable .safetensors file ({error})", path=path,
                     error=error) from None
    if lone is not None:
        check_family(source, lone, model_type, which)
        found = lone
    else:
        try:
            found = detect_model_type(path, expected=model_type)
        except SingleFileError as error:
            raise LoraToolError(str(error)) from None
    configs = (Path(config_folder) if config_folder
               else config_folder_for(family_files(found), path))
    return _layout(found, configs, path, source)


def _layout(model_type: ModelType, configs: Path, path: Path | None, source: str) -> ModelLayout:
    """Built on the meta device from the configs: the denoiser's class and the components the
    family's LoRA files name (`FileConventions.kohya_prefixes`) come from its family record."""
    import diffusers
    import transformers
    from accelerate import init_empty_weights
    from torch import nn

    files = family_files(model_type)
    denoiser = MODEL_TYPES[model_type].denoiser
    denoiser_cls = getattr(diffusers, files.denoiser_class)
    if not (configs / denoiser / "config.json").is_file():
        raise input_error("{configs}: has no {denoiser}/config.json ({cls}); name a {label} "
                          "diffusers folder as {config_folder}", configs=configs,
                          denoiser=denoiser, cls=files.denoiser_class,
                          label=MODEL_TYPES[model_type].label)
    unet_config = denoiser_cls.load_config(configs / denoiser)
    modules: dict[str, nn.Module] = {}
    with init_empty_weights():  # the meta device: names and shapes, no memory
        modules[denoiser] = denoiser_cls.from_config(unet_config)
        for name in MODEL_TYPES[model_type].text_encoders:
            if name not in files.kohya_prefixes:
                continue  # an encoder no LoRA file of the family names (Z-Image's Qwen3)
            config = transformers.AutoConfig.from_pretrained(configs / name, local_files_only=True)
            cls = getattr(transformers, (config.architectures or ["CLIPTextModel"])[0])
            modules[name] = cls(config)
    shapes: dict[LayerKey, tuple[int, ...]] = {}
    for component, module in modules.items():
        rename = str if component == denoiser else clip_key_with_text_model
        for name, layer in module.named_modules():
            if isinstance(layer, (nn.Linear, nn.Conv2d)):
                shapes[(component, rename(name))] = tuple(layer.weight.shape)
    layout = ModelLayout(model_type, source, shapes, unet_config, path, configs)
    layout.fused_rows = fused_rows(model_type, denoiser, {
        p: shape[0] for (c, p), shape in shapes.items() if c == denoiser})
    for key in shapes:
        try:
            name = layout.kohya_name(key)
        except (KohyaError, SingleFileError):
            continue  # a layer with no ldm name (e.g. SDXL's add_embedding) has no kohya name
        if name in layout.fused_rows:
            part = original_layer(files, key[1], shapes[key][0])[1]
            assert part is not None
            layout.fused_parts[key] = part
        else:
            layout.kohya_names[name] = key
        if key[0] in files.kohya_unfused_prefixes:
            # the same layer in the family's layout for LoHa / LoKr (Klein's `lycoris_` names)
            layout.kohya_names[unfused_module_name(files, key[0], key[1], model_type)] = key
    return layout


# --- where a layer's weight is stored -----------------------------------------------------
def weight_locations(layout: ModelLayout, keys: list[LayerKey]) -> dict[LayerKey, Location]:
    """Where each layer's weight is in the base's files (LoraToolError for one that is not)."""
    if layout.path is None:
        raise input_error("a base model's files are needed ({base})")
    if layout.is_single_file:
        return {key: _single_file_location(layout, key) for key in keys}
    headers: dict[str, dict[str, Path]] = {}
    out = {}
    for component, module_path in keys:
        if component not in headers:
            headers[component] = _component_keys(layout.path / component)
        names = headers[component]
        for candidate in (module_path, module_path.removeprefix("text_model.")):
            if candidate + ".weight" in names:
                out[(component, module_path)] = Location(names[candidate + ".weight"],
                                                         candidate + ".weight")
                break
        else:
            raise LoraToolError(f"{layout.path / component}: has no weight for {module_path}")
    return out


def component_files(folder: Path) -> list[Path]:
    """A component folder's weight files (one, or the shards of an index)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" ({', '.join(other)} are pickles: convert them first)" if other else ""
        raise LoraToolError(f"{folder}: no .safetensors weights{hint}")
    return files


def _component_keys(folder: Path) -> dict[str, Path]:
    from modules.lora_tools.streaming import read_header
    names: dict[str, Path] = {}
    for file in component_files(folder):
        names.update({key: file for key in read_header(file)[0] if key != "__metadata__"})
    return names


def _single_file_location(layout: ModelLayout, key: LayerKey) -> Location:
    component, module_path = key
    assert layout.path is not None
    files = family_files(layout.model_type)
    if component == layout.denoiser and files.denoiser_file_key is not None:
        key_name, rows = files.denoiser_file_key(module_path + ".weight", layout.shapes[key][0])
        stored = layout.file_shapes()
        # ComfyUI's split files have no prefix; some carry the checkpoints' one
        for candidate in (key_name, LDM_UNET_PREFIX + key_name):
            if candidate in stored:
                shape, expected = stored[candidate], layout.shapes[key]
                if (shape[1:] != expected[1:] or (rows is None and shape[0] != expected[0])
                        or (rows is not None and shape[0] < rows[1])):
                    raise input_error(
                        "{path}: {tensor} is {shape}, but the architecture configs ({configs}) "
                        "make {layer} {expected}: name this model's configs with "
                        "{config_folder} (a diffusers folder of it)", path=layout.path,
                        tensor=candidate, shape=shape, configs=layout.configs,
                        layer=module_path, expected=expected)
                return Location(layout.path, candidate, rows,
                                files.denoiser_file_stored(module_path + ".weight"))
        raise LoraToolError(f"{layout.path}: has no weight {key_name} (for {module_path})")
    if component == "unet":
        return Location(layout.path, LDM_UNET_PREFIX
                        + unet_key_to_ldm(module_path, layout.unet_config) + ".weight")
    prefix, kind = files.single_file_text_encoders[component]
    if kind == "hf":
        return Location(layout.path, prefix + module_path + ".weight")
    inner = module_path.removeprefix("text_model.")
    if m := re.fullmatch(r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj", inner):
        width = layout.shapes[key][0]
        start = "qkv".index(m[2]) * width
        return Location(layout.path, f"{prefix}transformer.resblocks.{m[1]}.attn.in_proj_weight",
                        (start, start + width))
    if m := re.fullmatch(r"encoder\.layers\.(\d+)\.(.*)", inner):
        return Location(layout.path, f"{prefix}transformer.resblocks.{m[1]}."
                        + _rename_head(m[2] + ".weight", OPEN_CLIP_LAYER_PARTS))
    raise LoraToolError(f"{component}: {module_path} has no place in an OpenCLIP single file")
