"""Caption embeddings on disk: one `.safetensors` per (caption, text encoder identity), so a
large text encoder (Z-Image's Qwen3-4B) encodes each caption once across runs and can leave the
GPU for the whole of training.

The identity hashes what decides an embedding: the model type (which layer and template its
family reads), every text encoder's config, tensor names, shapes, dtypes and weight bytes
(sampled past 64 MiB, as the latent cache samples a VAE's), and every tokenizer's vocabulary,
settings and chat template. Another encoder, dtype or template gives another folder; a file
that cannot be read is a miss, encoded again and rewritten, never a crash.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from modules.models.bundle import ModelBundle
from modules.util.atomic import atomic_file

logger = logging.getLogger("tempera.train")
STORE_FORMAT_VERSION = 1
# caption -> (hidden (length, D), pooled (D,) or None, real length or None): a cache row
Row = tuple[torch.Tensor, "torch.Tensor | None", "int | None"]


def encoder_identity(bundle: ModelBundle) -> str:
    """A short hash of everything that decides a caption's embedding (see the module's doc)."""
    from modules.data.latent_cache import vae_fingerprint
    parts: dict[str, object] = {"format": STORE_FORMAT_VERSION,
                                "model_type": bundle.model_type.value}
    for name, module in sorted(bundle.text_encoders.items()):
        parts[name] = vae_fingerprint(module)  # config and weights: any module's, not a VAE's
    for name, tokenizer in sorted(bundle.tokenizers.items()):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            # without the padding and truncation the last call set: state, not identity
            saved = {k: v for k, v in json.loads(backend.to_str()).items()
                     if k not in ("padding", "truncation")}
            vocab = json.dumps(saved, sort_keys=True)
        else:
            vocab = json.dumps(tokenizer.get_vocab(), sort_keys=True)
        parts[name] = hashlib.sha256((vocab + str(getattr(tokenizer, "chat_template", ""))
                                      + str(tokenizer.model_max_length)).encode()).hexdigest()
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


class TextEmbeddingStore:
    """The on-disk rows of one text encoder identity, under `<root>/<identity>/`."""

    def __init__(self, root: Path, identity: str) -> None:
        self.folder = Path(root) / identity
        self.read = self.written = 0

    def path(self, caption: str) -> Path:
        return self.folder / f"{hashlib.sha256(caption.encode('utf-8')).hexdigest()}.safetensors"

    def load(self, caption: str) -> Row | None:
        """The stored row of `caption`, or None (absent, unreadable or another caption)."""
        from safetensors import safe_open
        path = self.path(caption)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                if (f.metadata() or {}).get("caption") != caption:
                    return None
                hidden = f.get_tensor("hidden")
                pooled = f.get_tensor("pooled") if "pooled" in f.keys() else None
                length = f.get_tensor("length") if "length" in f.keys() else None
        except Exception as exc:  # safetensors raises its own error type for a damaged file
            logger.warning("text embedding cache file %s is unreadable (%s); encoding again",
                           path, exc)
            return None
        self.read += 1
        return hidden, pooled, None if length is None else int(length)

    def holds(self, caption: str) -> bool:
        """Whether the store has a readable row of `caption`, read from the file's header only
        (no tensor is loaded): safetensors refuses a file its header does not cover, so a
        truncated or damaged file is a miss here, as in `load`."""
        from safetensors import safe_open
        path = self.path(caption)
        if not path.is_file():
            return False
        try:
            with safe_open(str(path), framework="pt") as f:
                return ((f.metadata() or {}).get("caption") == caption
                        and "hidden" in f.keys())
        except Exception as exc:  # safetensors raises its own error type for a damaged file
            logger.warning("text embedding cache file %s is unreadable (%s); encoding again",
                           path, exc)
            return False

    def save(self, caption: str, row: Row) -> None:
        from safetensors.torch import save_file
        hidden, pooled, length = row
        tensors = {"hidden": hidden.detach().cpu().contiguous()}
        if pooled is not None:
            tensors["pooled"] = pooled.detach().cpu().contiguous()
        if length is not None:
            tensors["length"] = torch.tensor(length)
        self.folder.mkdir(parents=True, exist_ok=True)
        with atomic_file(self.path(caption)) as tmp:
            save_file(tensors, str(tmp), metadata={"caption": caption})
        self.written += 1


def encoder_files_key(folder: Path, subfolders: list[str], load: dict[str, str],
                      others: tuple[Path, ...] = ()) -> str:
    """A short hash of the files a folder's text encoders and tokenizers load from, read
    without loading them: each file's path in the folder and size, a `.safetensors` file's
    header (names, shapes, dtypes, offsets) and modification time, every other file's bytes
    (configs, vocabularies, chat templates), and `load` (the model type, the load dtypes).
    `remember_identity` maps it to the `encoder_identity` the loaded encoder had, so a run
    whose captions are all cached can find them without loading the encoder. `others`: files
    or folders outside `folder` read the same way, named by their absolute path (ComfyUI's
    text encoder file and tokenizer folder)."""
    digest = hashlib.sha256(json.dumps(load, sort_keys=True).encode())
    for name in sorted(subfolders):
        for path in sorted(p for p in (folder / name).rglob("*") if p.is_file()):
            _add_file(digest, path, path.relative_to(folder).as_posix())
    for other in others:
        paths = sorted(p for p in other.rglob("*") if p.is_file()) if other.is_dir() else [other]
        for path in paths:
            _add_file(digest, path, path.resolve().as_posix())
    return digest.hexdigest()[:16]


def _add_file(digest, path: Path, name: str) -> None:
    """One file into `encoder_files_key`'s digest: its name and size, a `.safetensors` file's
    header and modification time, any other file's bytes."""
    stat = path.stat()
    digest.update(f"{name}:{stat.st_size}".encode())
    if path.suffix == ".safetensors":
        digest.update(f":{stat.st_mtime_ns}".encode() + _safetensors_header(path))
    else:
        digest.update(path.read_bytes())


def _safetensors_header(path: Path) -> bytes:
    """A safetensors file's JSON header (its first 8 bytes give its length)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return f.read(min(length, 100 * 2**20))


def _identity_file(root: Path, files_key: str) -> Path:
    return Path(root) / "by-files" / f"{files_key}.json"


def remember_identity(root: Path, files_key: str, identity: str) -> None:
    """Note that the encoder loaded from the files of `files_key` has `identity`."""
    path = _identity_file(root, files_key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        Path(tmp).write_text(json.dumps({"identity": identity}), encoding="utf-8")


def known_identity(root: Path, files_key: str) -> str | None:
    """The identity `remember_identity` noted for `files_key`, or None (never noted, or a
    file that cannot be read: the encoder is then loaded and its identity computed)."""
    path = _identity_file(root, files_key)
    try:
        identity = json.loads(path.read_text(encoding="utf-8")).get("identity")
    except (OSError, ValueError, AttributeError):
        return None
    return identity if isinstance(identity, str) else None
