"""The dtype saved weights are written in (`output.save_dtype`), apart from the dtype a run
trains in: the live weights are never cast, only the copies that go into a file."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from modules.config.schema import SaveDType

# None: as trained (each writer's own choice: float32 for LoRA adapters, the component's
# dtype for full models).
SAVE_DTYPES: dict[SaveDType, torch.dtype | None] = {
    SaveDType.AS_TRAINED: None, SaveDType.FLOAT32: torch.float32,
    SaveDType.FLOAT16: torch.float16, SaveDType.BFLOAT16: torch.bfloat16}
# transformers writes the dtype a model was saved in into its config.json (older versions as
# torch_dtype, newer as dtype); `from_pretrained(dtype="auto")` reads it.
CONFIG_DTYPE_KEYS = ("torch_dtype", "dtype")


class SavePrecisionError(ValueError):
    """Weights that the chosen save dtype cannot hold."""


def cast_for_saving(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None,
                    where: str) -> dict[str, torch.Tensor]:
    """Copies of `tensors` on the CPU, contiguous, the floating-point ones at `dtype` (None:
    as they are). A cast that turns finite values into inf (float16 ends at 65504) is refused,
    naming the tensor: such a file would produce NaN images wherever it is loaded."""
    out = {}
    for key, value in tensors.items():
        value = value.detach()
        if dtype is not None and value.is_floating_point() and value.dtype != dtype:
            cast = value.to(dtype)
            if dtype == torch.float16 and bool(torch.isinf(cast).any()) \
                    and not bool(torch.isinf(value).any()):
                largest = float(value.abs().max())
                raise SavePrecisionError(
                    f"{where}: {key} holds {largest:g}, beyond float16's range (65504); "
                    "set output.save_dtype to BFLOAT16 or FLOAT32")
            value = cast
        out[key] = value.cpu().contiguous()
    return out


def cast_weight_files(folder: Path, dtype: torch.dtype) -> None:
    """Rewrite each .safetensors file of a saved diffusers component folder at `dtype` (tensor
    names and file metadata kept), and the dtype its config.json names, if it names one."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file(cast_for_saving(tensors, dtype, str(path)), str(path), metadata=metadata)
    config = Path(folder) / "config.json"
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        named = [key for key in CONFIG_DTYPE_KEYS if key in data]
        if named:
            data.update({key: str(dtype).removeprefix("torch.") for key in named})
            config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n",
                              encoding="utf-8")
