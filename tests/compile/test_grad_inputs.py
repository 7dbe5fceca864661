"""`SteadyGradInputs` (modules/compile/grad_inputs.py): a regional block that trains is always
handed inputs that require grad, so its first instance (fed by frozen layers) and the later ones
(fed through trained blocks) share one compiled graph; nothing it computes changes. The
compiled runs that show the recompile gone are tests/models/test_klein_compile.py's and
test_zimage_compile.py's."""
from __future__ import annotations

import torch
from torch import nn

from modules.compile.grad_inputs import SteadyGradInputs


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.side = nn.Linear(3, 4)

    def forward(self, x, emb, *, mask):
        return (self.proj(x) + self.side(emb)) * mask


def _inputs():
    torch.manual_seed(0)
    return torch.randn(2, 4), torch.randn(2, 3), torch.tensor([[1], [0]], dtype=torch.int64)


class Recording:
    """The inner call: records what it was handed."""

    def __init__(self, block):
        self.block, self.seen = block, []

    def __call__(self, *args, **kwargs):
        self.seen.append((args, kwargs))
        return self.block._call_impl(*args, **kwargs)


def test_a_trained_block_gets_inputs_that_require_grad_and_the_same_gradients():
    torch.manual_seed(1)
    block = Block()
    block.side.requires_grad_(False)  # a frozen layer beside a trained one, as under LoRA
    x, emb, mask = _inputs()
    plain = block(x, emb, mask=mask).square().sum()
    plain.backward()
    expected = block.proj.weight.grad.clone()
    block.zero_grad(set_to_none=True)

    inner = Recording(block)
    steady = SteadyGradInputs(inner, block)(x, emb, mask=mask).square().sum()
    steady.backward()
    (args, kwargs), = inner.seen
    assert all(a.requires_grad for a in args)          # both floating-point inputs
    assert not kwargs["mask"].requires_grad and kwargs["mask"] is mask  # an integer one as is
    assert torch.equal(steady, plain) and torch.equal(block.proj.weight.grad, expected)
    assert not x.requires_grad and x.grad is None      # the caller's tensors are not changed
    assert args[0].data_ptr() == x.data_ptr()          # the same storage, no copy


def test_without_grad_mode_or_a_trained_parameter_the_call_is_untouched():
    block = Block()
    x, emb, mask = _inputs()
    inner = Recording(block)
    with torch.no_grad():  # sampling, validation
        SteadyGradInputs(inner, block)(x, emb, mask=mask)
    block.requires_grad_(False)  # a frozen block: no backward through it to add
    SteadyGradInputs(inner, block)(x, emb, mask=mask)
    for args, kwargs in inner.seen:
        assert args[0] is x and args[1] is emb and kwargs["mask"] is mask


def test_an_input_that_requires_grad_already_keeps_its_graph():
    block = Block()
    source = torch.randn(2, 4, requires_grad=True)
    x = source * 2  # comes through a trained layer: gradients must reach `source`
    _, emb, mask = _inputs()
    SteadyGradInputs(Recording(block), block)(x, emb, mask=mask).sum().backward()
    assert source.grad is not None and source.grad.abs().sum() > 0
