"""Frozen weights stored in float8 (`model.weight_storage=FLOAT8`, issue 46 item 1).

The frozen linear layers of the denoiser and the text encoders are quantized with torchao's
float8 weight-only quantization (`Float8WeightOnlyConfig`: e4m3 values with one float32 scale
per output row). The layer stays an `nn.Linear` whose `weight` is a torchao `Float8Tensor`; its
forward dequantizes to the weight's original dtype (`model.weight_dtype`) and multiplies, which
dynamo traces into the block's graph (no graph break), and peft wraps it as its own
`TorchaoLoraLinear` so LoRA trains on top at `model.train_dtype`.

What torchao does not do here (checked on torch 2.13, torchao 0.18.0; docs/memory.md):
convolutions (its float8 conv needs the CUDA-only `mslk` kernels), so they stay at
`model.weight_dtype`; and autograd keeps the dequantized weight of each layer for the backward
pass (eager and AOTAutograd alike), so the saving holds at rest and between steps, while a
step's backward holds a dequantized copy per layer whose activations it keeps (gradient
checkpointing bounds that to one block).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch import nn

FLOAT8_DTYPE = torch.float8_e4m3fn
PACKAGE = "torchao"


def is_float8(tensor: torch.Tensor) -> bool:
    """A weight stored by `store_float8` (a torchao Float8Tensor)."""
    return type(tensor).__name__ == "Float8Tensor"


def _frozen_linear(module: nn.Module, _fqn: str) -> bool:
    return (type(module) is nn.Linear and not module.weight.requires_grad
            and not is_float8(module.weight))


def store_float8(module: nn.Module) -> int:
    """Store `module`'s frozen `nn.Linear` weights as float8 e4m3 with per-row scales, in
    place (on whatever device it is, the meta device included); returns how many layers."""
    from torchao.quantization import Float8WeightOnlyConfig, PerRow, quantize_

    count = sum(1 for name, m in module.named_modules() if _frozen_linear(m, name))
    if count:
        quantize_(module, Float8WeightOnlyConfig(weight_dtype=FLOAT8_DTYPE, granularity=PerRow(),
                                                 set_inductor_config=False),
                  filter_fn=_frozen_linear)
    return count


@contextmanager
def quiet_torchao_lora():
    """peft warns, once per layer it wraps, that a torchao layer it adapts cannot be merged
    (`TorchaoLoraLinear` without `get_apply_tensor_subclass`). Tempera never merges adapters
    into a float8 base (it saves the adapters alone), so that one warning is filtered by its
    text while adapters are added; any other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated without")
        yield


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: a float8 weight is its e4m3 values plus its scales."""
    if is_float8(tensor):
        # torchao's Float8Tensor is a tensor subclass: it flattens to its inner tensors' names
        inner: list[str] = tensor.__tensor_flatten__()[0]  # type: ignore[attr-defined]
        return sum(stored_bytes(getattr(tensor, name)) for name in inner)
    return tensor.numel() * tensor.element_size()


def float8_weights(module: nn.Module) -> list[torch.Tensor]:
    """The weights of `module` stored as float8."""
    return [p for p in module.parameters() if is_float8(p)]


def storage_record(components: dict[str, nn.Module]) -> dict:
    """run.json's `weight_storage` for FLOAT8: per component, the layers stored as float8 and
    their bytes (values and scales), and the library that does it."""
    from importlib.metadata import version

    stored = {name: float8_weights(module) for name, module in components.items()}
    return {"storage": "FLOAT8", "library": f"{PACKAGE} {version(PACKAGE)}",
            "format": "float8_e4m3fn values, one float32 scale per output row",
            "components": {name: {"layers": len(weights),
                                  "bytes": sum(stored_bytes(w) for w in weights)}
                           for name, weights in stored.items() if weights}}
