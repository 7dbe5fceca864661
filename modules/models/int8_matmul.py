"""Int8 matmuls for the frozen linear layers under a LoRA (`model.weight_storage=W8A8`, issue 58
item 2).

Each frozen `nn.Linear` of the denoiser becomes a `W8A8Linear`: its weight is kept as int8
values with one float32 scale per output row (the quantization of INT8 storage: symmetric,
scale = row max / 127.5, values in [-128, 127]; tests/models/test_int8_matmul.py checks it equals
torchao's `Int8WeightOnlyConfig`), and its forward quantizes the input per token (one scale per
row of the flattened input, symmetric, [-127, 127]), multiplies int8 x int8 -> int32 with
`torch._int_mm` and rescales to the input's dtype.

Why an autograd function of its own: torchao's `Int8DynamicActivationInt8WeightConfig` gives an
output with no `grad_fn` when the weight is frozen, so under a LoRA every earlier layer would
train on the adapters' gradient alone (tests/train/test_w8a8_gradient.py). `Int8Matmul`'s
backward gives the input gradient against the dequantized weight, in the gradient's dtype: the
exact gradient of `x @ dequantized(W).T` (the activation rounding passes the gradient straight
through), and no weight gradient (the weight is frozen). It saves only the int8 weight and its
scales for backward (already resident), never a 16-bit copy of the weight.

Shapes: `torch._int_mm` on CUDA (cuBLASLt) needs more than 16 rows and both other dimensions
multiples of 8. A layer call outside that (a time-embedding projection of one row per image)
multiplies the input by the dequantized weight instead, on every device alike, so the CPU
computes what a GPU does. Dynamo traces the function and `torch._int_mm` into the block's graph
(no graph break; tests/train/test_w8a8.py).
"""
from __future__ import annotations

import torch
from torch import nn

WEIGHT_LEVELS = 127.5   # INT8 storage's symmetric mapping: row max -> 127.5, [-128, 127]
ACTIVATION_LEVELS = 127.0
MIN_ROWS = 17           # torch._int_mm (CUDA): "self.size(0) needs to be greater than 16"
MULTIPLE = 8            # and its two other dimensions multiples of 8
TINY = 1e-12            # an all-zero token's scale (its values stay 0)
WEIGHT_EPS = torch.finfo(torch.float32).eps  # the smallest weight scale, as torchao's


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and one float32 scale per output row of a linear weight (out, in)."""
    scale = (weight.detach().float().abs().amax(dim=1) / WEIGHT_LEVELS).clamp(min=WEIGHT_EPS)
    # times the reciprocal, as torchao's quantize_affine: the same int8 values to the bit
    values = torch.round(weight.detach().float() * (1.0 / scale[:, None])).clamp(-128, 127)
    return values.to(torch.int8), scale


def dequantize_rows(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight `quantize_rows` stored, at `dtype`."""
    return (values.float() * scale.float()[:, None]).to(dtype)


def int_mm_fits(rows: int, weight_shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether `torch._int_mm` takes a (rows, in) x (in, out) product (CUDA's rule, used on
    every device)."""
    out_features, in_features = weight_shape
    return (rows >= MIN_ROWS and in_features % MULTIPLE == 0
            and out_features % MULTIPLE == 0)


def int8_linear(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` with `x` quantized per token and W = (values, scale), in int8 arithmetic; at
    x's dtype. The forward of `Int8Matmul` (no autograd of its own)."""
    flat = x.reshape(-1, x.shape[-1])
    if not int_mm_fits(flat.shape[0], values.shape):
        return nn.functional.linear(x, dequantize_rows(values, scale, x.dtype))
    x_scale = flat.float().abs().amax(dim=1, keepdim=True).clamp(min=TINY) / ACTIVATION_LEVELS
    x_values = torch.round(flat.float() / x_scale).clamp(-127, 127).to(torch.int8)
    # values.t() is a column-major view: the layout cuBLASLt's int8 kernel reads directly
    product = torch._int_mm(x_values, values.t())
    out = product.float() * x_scale * scale.float()[None, :]
    return out.to(x.dtype).reshape(*x.shape[:-1], values.shape[0])


class Int8Matmul(torch.autograd.Function):
    """int8 forward, the dequantized weight's input gradient backward (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, values: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(values, scale)
        return int8_linear(x, values, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        values, scale = ctx.saved_tensors
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = grad @ dequantize_rows(values, scale, grad.dtype)
        return grad_input, None, None


class W8A8Linear(nn.Linear):
    """A frozen linear layer whose matmul runs in int8 (`Int8Matmul`). Still an `nn.Linear`
    (with `weight` the int8 values, `weight_scale` their row scales), so peft wraps it with its
    own LoRA layer as it wraps any linear layer; the bias stays at its dtype and is added
    outside the function (autograd handles it as usual)."""

    weight_scale: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        values, scale = quantize_rows(linear.weight)
        self.weight = nn.Parameter(values, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = Int8Matmul.apply(x, self.weight, self.weight_scale)
        return out if self.bias is None else out + self.bias

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the int8 values stand for, at `dtype`."""
        return dequantize_rows(self.weight, self.weight_scale, dtype)


def store_w8a8(module: nn.Module) -> int:
    """Replace `module`'s frozen `nn.Linear` layers (exactly that class, weights not trained)
    by `W8A8Linear`, in place, on whatever device they are (the meta device included); returns
    how many."""
    found = [(name, child) for name, child in module.named_modules()
             if type(child) is nn.Linear and not child.weight.requires_grad]
    for name, child in found:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, W8A8Linear(child))
    return len(found)


def w8a8_layers(module: nn.Module) -> list[W8A8Linear]:
    """The `W8A8Linear` layers of `module` (peft's wrappers hold them as their base layer)."""
    return [m for m in module.modules() if isinstance(m, W8A8Linear)]


def int_mm_problem(device: torch.device) -> str:
    """Why `device` cannot run `torch._int_mm`, or "" when it can: one small product of the
    shape the layers use, checked against the exact integer result. How "supported" is decided
    off CUDA (on CUDA the compute capability decides first: levers.py's INT8_MATMUL_NEED)."""
    a = torch.arange(-64, 64, dtype=torch.int8).reshape(MIN_ROWS + 15, 4).repeat(1, 2)
    b = torch.arange(64, dtype=torch.int8).reshape(8, 8) - 32
    try:
        got = torch._int_mm(a.to(device), b.to(device)).cpu()
    except (RuntimeError, NotImplementedError) as err:
        return f"torch._int_mm has no kernel there ({str(err).splitlines()[0]})"
    if not torch.equal(got, a.int() @ b.int()):
        return "torch._int_mm gave a wrong product there"
    return ""
