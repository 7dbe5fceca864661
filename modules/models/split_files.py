"""ComfyUI's split files: a diffusion model, a text encoder and a VAE, three .safetensors files
named by `model.path`, `model.text_encoder_path` and `model.vae_path`. Checked from their
headers alone (nothing loaded): each file there, readable, and the part its field names. The
families that take them say, in their file-layout modules, what each part is (`part_of`) and
what else the three must agree on.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from modules.config.problems import Problem

Keys = dict[str, tuple[int, ...]]
# the field that names each part
FIELDS = {"transformer": "model.path", "text_encoder": "model.text_encoder_path",
          "vae": "model.vae_path"}


def keys_of(path: Path) -> Keys:
    """A .safetensors file's tensor names and shapes, read from its header only."""
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def check_parts(model: Any, family: str, labels: Mapping[str, str],
                part_of: Callable[[Keys], tuple[str | None, str]]
                ) -> tuple[list[Problem], dict[str, Keys]]:
    """Every problem with the three files (a field left empty, no such file, not a
    .safetensors file, an unreadable header, a file that is another part or no part of
    `family`'s), each naming its field, the file and what was expected; and the keys of each
    file that could be read, by the part its field names."""
    given = {part: getattr(model, field.removeprefix("model.")) for part, field in FIELDS.items()}
    problems: list[Problem] = []
    read: dict[str, Keys] = {}
    for part, value in given.items():
        field, expected = FIELDS[part], labels[part]
        if not value:
            problems.append(Problem(field, f"the .safetensors file of {expected}", "''",
                                    f"a {family} diffusion-model file comes without its text "
                                    "encoder and VAE: name each file (ComfyUI keeps them in "
                                    "models/text_encoders and models/vae)"))
            continue
        path = Path(value)
        if not path.is_file() or path.suffix.lower() != ".safetensors":
            problems.append(Problem(field, f"the .safetensors file of {expected}", repr(value),
                                    "no such file" if not path.exists() else "not a "
                                    ".safetensors file"))
            continue
        try:
            keys = keys_of(path)
        except Exception as exc:  # safetensors raises its own error type for a bad header
            problems.append(Problem(field, expected, repr(value), f"not a readable "
                                    f".safetensors file ({exc}); the download may be "
                                    "incomplete"))
            continue
        found, what = part_of(keys)
        if found != part:
            hint = f"; it belongs in {FIELDS[found]}" if found else ""
            problems.append(Problem(field, expected, repr(value), f"{path.name} is {what}{hint}"))
        read[part] = keys
    return problems, read


def load_qwen3(path: str, config_folder: Path, dtype: Any) -> Any:
    """A Qwen3 text encoder file (ComfyUI's `text_encoders/` kind: the causal LM's weights,
    under `model.` or not) as a Qwen3Model built from `config_folder`'s text_encoder config;
    SingleFileError when its weights do not fit that config."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3Model

    from modules.models.single_file import SingleFileError
    encoder = Qwen3Model(Qwen3Config.from_pretrained(config_folder / "text_encoder",
                                                     local_files_only=True))
    weights = {k.removeprefix("model."): v for k, v in load_file(path).items()
               if k != "lm_head.weight"}  # the head is never read (tied in Qwen3-4B)
    missing, unexpected = encoder.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise SingleFileError(f"{path}: does not fit the Qwen3 config of "
                              f"{config_folder / 'text_encoder'} ({len(missing)} weights "
                              f"missing, e.g. {missing[:1]}; {len(unexpected)} unexpected, e.g. "
                              f"{unexpected[:1]})")
    encoder.to(dtype)
    return encoder.eval()  # as from_pretrained leaves a model


def tokenizer_folder(model: Any, config_folder: Path) -> Path:
    """The folder the tokenizer loads from: model.tokenizer_path (a diffusers folder's
    tokenizer/, or a tokenizer folder), else `config_folder`'s."""
    folder = Path(model.tokenizer_path or config_folder)
    return folder / "tokenizer" if (folder / "tokenizer").is_dir() else folder


def load_tokenizer(model: Any, config_folder: Path) -> Any:
    """The tokenizer of `tokenizer_folder`."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_folder(model, config_folder),
                                         local_files_only=True)


def load_split_text(model: Any, config_folder: Path, dtypes: Any
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen3 from model.text_encoder_path alone and the tokenizer, as ({"text_encoder": ...},
    {"tokenizer": ...}): the text part of the split files, for a run that caches its captions
    before the diffusion model and VAE load (train/setup/text_first.py)."""
    from modules.models.bundle import dtype_of
    encoder = load_qwen3(model.text_encoder_path, config_folder, dtype_of(dtypes, "text_encoder"))
    return {"text_encoder": encoder}, {"tokenizer": load_tokenizer(model, config_folder)}
