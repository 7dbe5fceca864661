"""The base model's hashes that kohya-style LoRA files carry, so A1111 and Forge can say which
checkpoint a LoRA was trained on: `ss_sd_model_hash` (A1111's old short hash: sha256 of the
64 KiB at offset 1 MiB, 8 hex digits) and `ss_new_sd_model_hash` (the file's full sha256, what
A1111 shows today). Hashing a 7 GB SDXL checkpoint reads all of it (several seconds), so the
result is remembered in the cache folder per (path, size, modification time)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from modules.util.atomic import atomic_write_text

MEMO_FILE = "model-hashes.json"
_LEGACY_OFFSET, _LEGACY_LENGTH = 0x100000, 0x10000
_CHUNK = 1 << 22


def legacy_model_hash(path: Path) -> str:
    """A1111's short model hash (before it hashed whole files)."""
    with open(path, "rb") as file:
        file.seek(_LEGACY_OFFSET)
        return hashlib.sha256(file.read(_LEGACY_LENGTH)).hexdigest()[:8]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def base_model_hashes(model_path: str, cache_dir: Path) -> dict[str, str]:
    """The two hash keys for a single-file base model; {} for a diffusers folder or a built-in
    model, which no tool identifies by a hash (the files then carry `ss_sd_model_name` only).
    A memo file that cannot be read is recomputed and rewritten, never trusted."""
    path = Path(model_path)
    if not path.is_file():
        return {}
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo_path = Path(cache_dir) / MEMO_FILE
    memo = _read_memo(memo_path)
    if key not in memo:
        memo[key] = {"ss_sd_model_hash": legacy_model_hash(path),
                     "ss_new_sd_model_hash": file_sha256(path)}
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(memo_path, json.dumps(memo, indent=1) + "\n")
    return dict(memo[key])


def _read_memo(path: Path) -> dict:
    try:
        memo = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(memo, dict):
        return {}
    return {k: v for k, v in memo.items() if isinstance(v, dict)
            and set(v) == {"ss_sd_model_hash", "ss_new_sd_model_hash"}}
