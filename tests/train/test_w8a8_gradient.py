"""Why W8A8 (int8 matmuls) is Tempera's own autograd function (modules/models/int8_matmul.py,
docs/memory.md, issue 58 item 2) and not torchao's config: with torchao's
`Int8DynamicActivationInt8WeightConfig` a frozen layer's output does not carry the gradient back
to its input, so every layer before it would train on the LoRA branches' gradient alone,
silently; the INT8 weight-only storage does carry it, and so does Tempera's W8A8
(tests/models/test_int8_matmul.py). When a torchao release fixes this, this test fails: then
torchao's config could replace Tempera's function."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
quantization = pytest.importorskip("torchao.quantization")


def _frozen_output(config):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64, dtype=torch.bfloat16).requires_grad_(False)
    quantization.quantize_(layer, config)
    return layer(torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True))


def test_w8a8_drops_the_gradient_through_a_frozen_layer_and_int8_storage_keeps_it():
    dropped = _frozen_output(quantization.Int8DynamicActivationInt8WeightConfig())
    assert dropped.grad_fn is None and not dropped.requires_grad
    kept = _frozen_output(quantization.Int8WeightOnlyConfig())
    assert kept.requires_grad and kept.grad_fn is not None
