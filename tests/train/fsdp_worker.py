"""Run by tests/train/test_fsdp.py under torchrun (2 gloo processes): a module sharded block by
block as `Distributed.shard_trained` shards one, against an unsharded copy given the same
input on every rank. Prints one JSON line from rank 0."""
from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
from torch import nn

from modules.train.recipe.distributed import (Distributed, clip_sharded_gradients, full_tensor,
                                              local_tensor)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 10)
        self.outer = nn.Linear(10, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), Block(), Block(), nn.Linear(6, 3))  # 3 rows: uneven
    whole = copy.deepcopy(model)
    sharded = Distributed(rank, world, "gloo", torch.device("cpu"))
    sharded.strategy = sharded.strategy.FSDP
    assert sharded.shard_trained({"net": model}, {"net": ("Block",)}) == ["net"]
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    for net in (model, whole):
        net(x).pow(2).mean().backward()
    reference = torch.nn.utils.clip_grad_norm_(list(whole.parameters()), 0.01)
    params = list(model.parameters())
    norm = clip_sharded_gradients(params, 0.01)
    clipped = max(float((full_tensor(p.grad) - w.grad).abs().max())
                  for p, w in zip(params, whole.parameters()))
    local = sum(local_tensor(p).numel() * p.element_size() for p in params)
    if rank == 0:
        print(json.dumps({"norm": float(norm), "reference": float(reference),
                          "max_clipped_difference": clipped, "local_bytes": local,
                          "whole_bytes": sum(p.numel() * p.element_size()
                                             for p in whole.parameters()),
                          "sharded_blocks": sum(type(m).__name__ == "FSDPBlock"
                                                for m in model.modules())}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
