"""Rewrite a .safetensors file one tensor at a time, so merging into an SDXL checkpoint holds
one of its tensors in memory, never a second copy of the model.

The output has the input's header (same names, dtypes, shapes and offsets: a merged weight
keeps its dtype and shape), so the header is written first and then each tensor's bytes in
order: untouched tensors are copied as raw bytes, never made into tensors; a changed one is
read with safetensors' `safe_open`, changed in float32 and written, then dropped.
"""
from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch

# A tensor key -> the function that returns its new value from the stored one.
Change = Callable[[torch.Tensor], torch.Tensor]
COPY_CHUNK = 16 << 20


def read_header(path: Path) -> tuple[dict, int]:
    """A .safetensors file's JSON header and the offset its data starts at."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: too short to be a .safetensors file")
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: not a readable .safetensors file ({error})") from None
    return header, 8 + size


def rewrite(source: Path, target: Path, changes: dict[str, Change],
            metadata: dict[str, str] | None = None) -> int:
    """Write `source` to `target` with `changes` applied, one tensor at a time; returns how many
    tensors were changed. `metadata` entries are added to the header's."""
    from safetensors import safe_open

    header, start = read_header(source)
    missing = sorted(set(changes) - set(header))
    if missing:
        raise KeyError(f"{source}: has no tensor {missing[0]!r}")
    out_header = dict(header)
    if metadata:
        out_header["__metadata__"] = {**header.get("__metadata__", {}), **metadata}
    text = json.dumps(out_header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    order = sorted((k for k in header if k != "__metadata__"),
                   key=lambda k: header[k]["data_offsets"][0])
    with open(source, "rb") as raw, safe_open(str(source), "pt") as tensors, \
            open(target, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for key in order:
            begin, end = header[key]["data_offsets"]
            if key not in changes:
                raw.seek(start + begin)
                _copy(raw, out, end - begin)
                continue
            stored = tensors.get_tensor(key)
            new = changes[key](stored).to(stored.dtype).contiguous()
            del stored
            if new.numel() * new.element_size() != end - begin:
                raise ValueError(f"{source}: {key}: the change altered the tensor's size")
            out.write(new.view(torch.uint8).numpy().tobytes())
            del new
    return len(changes)


def _copy(src, dst, size: int) -> None:
    while size > 0:
        chunk = src.read(min(size, COPY_CHUNK))
        if not chunk:
            raise ValueError("the file ended before its header said")
        dst.write(chunk)
        size -= len(chunk)


def copy_tree_except(source: Path, target: Path, skip: set[Path]) -> None:
    """Copy a folder's files into `target` (which exists), leaving out `skip`."""
    for path in sorted(source.rglob("*")):
        if path.is_file() and path not in skip:
            dest = target / path.relative_to(source)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)


# A tensor written by `write_streamed`: its name, safetensors dtype, shape and the function that
# makes it when its turn comes.
Entry = tuple[str, str, list[int], Callable[[], torch.Tensor]]


def write_streamed(target: Path, entries: list[Entry], metadata: dict[str, str]) -> None:
    """Write a .safetensors file whose tensors are made one at a time by `entries`' functions
    (each dropped once written), the header first from the declared dtypes and shapes."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    sizes = []
    for key, dtype, shape, _ in entries:
        size = DTYPE_SIZES[dtype] * _count(shape)
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
        sizes.append(size)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(target, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for (key, _, shape, make), size in zip(entries, sizes):
            tensor = make().contiguous()
            if list(tensor.shape) != shape or tensor.numel() * tensor.element_size() != size:
                raise ValueError(f"{key}: made {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"declared {shape}")
            out.write(tensor.view(torch.uint8).numpy().tobytes() if size else b"")
            del tensor


def _count(shape: list[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
SAFETENSORS_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}
