"""Frozen weights stored in 8 bits (`model.weight_storage=FLOAT8` or `INT8`; issue 46 item 1,
issue 58 item 1).

The frozen linear layers of the denoiser and the text encoders are quantized with torchao's
weight-only quantization, one table row per format (`FORMATS`):
- FLOAT8: `Float8WeightOnlyConfig`, e4m3 values with one float32 scale per output row; a torchao
  `Float8Tensor`;
- INT8: `Int8WeightOnlyConfig`, int8 values with one float32 scale and one int8 zero point per
  output row; a torchao `Int8Tensor`. For the cards without float8 arithmetic (RTX 30 series
  and older): it stores the same byte a value, and needs no float8 dtype anywhere.
- W8A8: Tempera's own (models/int8_matmul.py, no torchao): the denoiser's layers become
  `W8A8Linear`, int8 values and one float32 scale per output row (INT8's quantization without
  the zero point, which is 0), multiplied in int8 with activations quantized per token.
The layer of a torchao row stays an `nn.Linear` whose `weight` is the torchao tensor; its forward dequantizes to
the weight's original dtype (`model.weight_dtype`) and multiplies, which dynamo traces into the
block's graph (no graph break), and peft wraps it as its own `TorchaoLoraLinear` so LoRA trains
on top at `model.train_dtype`.

What torchao does not do here (checked on torch 2.13, torchao 0.18.0; docs/memory.md):
convolutions (its float8 conv needs the CUDA-only `mslk` kernels), so they stay at
`model.weight_dtype`; and autograd keeps the dequantized weight of each layer for the backward
pass (eager and AOTAutograd alike), so the saving holds at rest and between steps, while a
step's backward holds a dequantized copy per layer whose activations it keeps (gradient
checkpointing bounds that to one block).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modules.models.int8_matmul import store_w8a8, w8a8_layers

FLOAT8_DTYPE = torch.float8_e4m3fn
PACKAGE = "torchao"


def _float8_config() -> Any:
    from torchao.quantization import Float8WeightOnlyConfig, PerRow
    return Float8WeightOnlyConfig(weight_dtype=FLOAT8_DTYPE, granularity=PerRow(),
                                  set_inductor_config=False)


def _int8_config() -> Any:
    from torchao.quantization import Int8WeightOnlyConfig
    return Int8WeightOnlyConfig(set_inductor_config=False)


@dataclass(frozen=True)
class StoredFormat:
    """One way of storing frozen linear weights: what `model.weight_storage` names."""
    key: str                         # the model.weight_storage value
    tensor_class: str                # torchao's tensor subclass a stored weight is
    word: str                        # as sentences say it ("float8")
    layout: str                      # run.json's format, and the memory plan's line
    config: Callable[[], Any] | None  # the torchao quantization config that stores it
    library: str = PACKAGE           # the package run.json names ("torch" for W8A8)


FORMATS: dict[str, StoredFormat] = {
    "FLOAT8": StoredFormat("FLOAT8", "Float8Tensor", "float8",
                           "float8_e4m3fn values, one float32 scale per output row",
                           _float8_config),
    "INT8": StoredFormat("INT8", "Int8Tensor", "int8",
                         "int8 values, one float32 scale and one int8 zero point per output row",
                         _int8_config),
    "W8A8": StoredFormat("W8A8", "", "int8 for int8 matmuls",
                         "int8 values, one float32 scale per output row; inputs quantized to "
                         "int8 per token, int8 x int8 matmuls (torch._int_mm)",
                         None, "torch"),
}
_CLASSES = {f.tensor_class: f for f in FORMATS.values() if f.tensor_class}


def stored_format(tensor: torch.Tensor) -> StoredFormat | None:
    """The format a weight was stored in by `store_weights`, or None for a plain tensor (an
    int8 parameter or buffer is W8A8's: nothing else in the models is int8)."""
    if tensor.dtype == torch.int8 and type(tensor) in (torch.Tensor, nn.Parameter):
        return FORMATS["W8A8"]
    return _CLASSES.get(type(tensor).__name__)


def is_stored(tensor: torch.Tensor) -> bool:
    """A weight stored in 8 bits by `store_weights` (a torchao tensor of a `FORMATS` row)."""
    return stored_format(tensor) is not None


def _frozen_linear(module: nn.Module, _fqn: str) -> bool:
    return (type(module) is nn.Linear and not module.weight.requires_grad
            and not is_stored(module.weight))


def store_weights(module: nn.Module, storage: str) -> int:
    """Store `module`'s frozen `nn.Linear` weights in the format `storage` names (a `FORMATS`
    key), in place (on whatever device it is, the meta device included); returns how many
    layers."""
    if storage == "W8A8":
        return store_w8a8(module)
    from torchao.quantization import quantize_

    count = sum(1 for name, m in module.named_modules() if _frozen_linear(m, name))
    if count:
        config = FORMATS[storage].config
        assert config is not None  # every row but W8A8's is torchao's
        quantize_(module, config(), filter_fn=_frozen_linear)
    return count


@contextmanager
def quiet_torchao_lora():
    """peft warns, once per layer it wraps, that a torchao layer it adapts cannot be merged
    (`TorchaoLoraLinear` without `get_apply_tensor_subclass`). Tempera never merges adapters
    into a float8 base (it saves the adapters alone), so that one warning is filtered by its
    text while adapters are added; any other warning passes. The same for int8."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated without")
        yield


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: a stored weight is its 8-bit values plus its scales (and zero
    points)."""
    if is_stored(tensor) and tensor.dtype != torch.int8:  # W8A8's values are a plain tensor
        # torchao's tensors are tensor subclasses: each flattens to its inner tensors' names
        inner: list[str] = tensor.__tensor_flatten__()[0]  # type: ignore[attr-defined]
        return sum(stored_bytes(getattr(tensor, name)) for name in inner)
    return tensor.numel() * tensor.element_size()


def stored_weights(module: nn.Module) -> list[torch.Tensor]:
    """The weights of `module` stored in 8 bits."""
    return [p for p in module.parameters() if is_stored(p)]


def stored_tensors(module: nn.Module) -> list[torch.Tensor]:
    """What the 8-bit layers of `module` hold: the stored weights, and W8A8's scales (a buffer
    beside the weight; torchao's are inside it)."""
    return stored_weights(module) + [layer.weight_scale for layer in w8a8_layers(module)]


def storage_record(components: dict[str, nn.Module], storage: str) -> dict:
    """run.json's `weight_storage` for a `FORMATS` storage: per component, the layers stored
    and their bytes (values and scales), and the library that does it."""
    from importlib.metadata import version

    stored = {name: stored_weights(module) for name, module in components.items()}
    held = {name: stored_tensors(module) for name, module in components.items()}
    library = FORMATS[storage].library
    return {"storage": storage, "library": f"{library} {version(library)}",
            "format": FORMATS[storage].layout,
            "components": {name: {"layers": len(weights),
                                  "bytes": sum(stored_bytes(t) for t in held[name])}
                           for name, weights in stored.items() if weights}}
