"""One graph per block shape, not two: a trained block's inputs always require grad.

Dynamo guards each compiled graph on whether its tensor inputs require grad. Under REGIONAL
scope with adapters (LoRA and the like), the first trained block of a class takes an input that
does not (it comes from frozen layers), and every later one takes an input that does (it comes
through a trained block): the same block class then compiles twice, forward and backward, in
the first step ("requires_grad mismatch" in the recompile log; measured on Flux.2 Klein's
double-stream block and SD 1.5's transformer block). `SteadyGradInputs` stands between a
regional block and its compiled code and, while gradients are on and the block holds a trained
parameter, hands it every floating-point tensor argument as one that requires grad, so every
instance meets the graph the first one compiled.

What it changes: the values, the loss and every trained parameter's gradient are those of the
same step without it (an input that did not require grad gets a new leaf that does, sharing its
storage; no gradient reaches anything upstream, because nothing upstream needed one). What it
costs: the gradient of those inputs, computed in the backward of trained blocks, whose backward
runs anyway; for the first trained block's input and for side inputs such as the timestep
embedding that is one extra product per layer that reads them. Blocks holding no trained
parameter are left alone: making their inputs require grad would run a backward through them
that eager training skips (in SD 1.5's UNet under attention-only LoRA, the first ResNet block
still compiles a second graph for that reason).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _requiring_grad(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad:
        return value.detach().requires_grad_()
    return value


class SteadyGradInputs:
    """Calls ``inner`` (a block's compiled call) with its floating-point tensor arguments
    requiring grad while grad mode is on and ``module`` holds a parameter that requires grad."""

    def __init__(self, inner: Callable[..., Any], module: nn.Module):
        self.inner = inner
        self.module = module

    def trained(self) -> bool:
        # asked each call: what trains can change during a run (a text encoder that stops)
        return any(p.requires_grad for p in self.module.parameters())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.trained():
            args = tuple(_requiring_grad(a) for a in args)
            kwargs = {name: _requiring_grad(v) for name, v in kwargs.items()}
        return self.inner(*args, **kwargs)
