"""The base model's hashes in LoRA metadata: what A1111 computes, remembered per file state."""
from __future__ import annotations

import hashlib
import json
import os

from modules.models.model_hash import MEMO_FILE, base_model_hashes


def _checkpoint(tmp_path, size=0x130000, seed=1):
    data = bytes((i * 7 + seed) % 251 for i in range(size))
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    return path, data


def test_the_hashes_are_a1111s_short_and_full_ones(tmp_path):
    path, data = _checkpoint(tmp_path)
    hashes = base_model_hashes(str(path), tmp_path / "cache")
    assert hashes == {"ss_sd_model_hash": hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8],
                      "ss_new_sd_model_hash": hashlib.sha256(data).hexdigest()}


def test_a_folder_or_builtin_model_has_no_hash(tmp_path):
    assert base_model_hashes(str(tmp_path), tmp_path / "cache") == {}
    assert base_model_hashes("builtin:tiny-sd15", tmp_path / "cache") == {}


def test_the_memo_is_used_until_the_file_changes(tmp_path):
    path, _ = _checkpoint(tmp_path)
    cache = tmp_path / "cache"
    first = base_model_hashes(str(path), cache)
    memo = json.loads((cache / MEMO_FILE).read_text())
    (key,) = memo
    memo[key]["ss_new_sd_model_hash"] = "remembered"
    (cache / MEMO_FILE).write_text(json.dumps(memo))
    assert base_model_hashes(str(path), cache)["ss_new_sd_model_hash"] == "remembered"
    _, data = _checkpoint(tmp_path, seed=2)  # same size, new bytes and modification time
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again = base_model_hashes(str(path), cache)
    assert again["ss_new_sd_model_hash"] == hashlib.sha256(data).hexdigest() != first[
        "ss_new_sd_model_hash"]


def test_a_damaged_memo_is_recomputed_not_trusted(tmp_path):
    path, data = _checkpoint(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / MEMO_FILE).write_text("{not json")
    assert base_model_hashes(str(path), cache)["ss_new_sd_model_hash"] == hashlib.sha256(
        data).hexdigest()
    assert json.loads((cache / MEMO_FILE).read_text())  # rewritten, readable
