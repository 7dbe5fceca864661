"""Run by tests/train/test_fsdp.py as each of 2 gloo processes: a module sharded block by block
as `Distributed.shard_trained` shards one, against an unsharded copy given the same input on
every rank (gradient norm and clipping), and the tiny UNet's two REGIONAL block classes
compiled (AOT_EAGER) sharded and unsharded (graphs, graph breaks, recompiles). Rank 0 prints
one line, `sharding checks: ` and JSON. Given scripts/train.py's arguments, each rank then
trains in the same process group (Accelerate joins a group already initialized), so one
launch of the two processes serves these checks and a training run."""
from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from modules.train.recipe.distributed import (Distributed, clip_sharded_gradients, full_tensor,
                                              local_tensor)


class Blocks(nn.Module):
    """diffusers' two blocks REGIONAL compiles in SD's UNet, at the tiny UNet's sizes."""

    def __init__(self) -> None:
        super().__init__()
        from diffusers.models.attention import BasicTransformerBlock
        from diffusers.models.resnet import ResnetBlock2D
        self.resnet = ResnetBlock2D(in_channels=32, out_channels=32, temb_channels=32)
        self.attention = BasicTransformerBlock(32, 2, 16, cross_attention_dim=32)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        x = self.resnet(x, temb)
        tokens = x.flatten(2).transpose(1, 2)
        return self.attention(tokens, encoder_hidden_states=text)


def compile_counts(blocks: Blocks, shard: Distributed | None) -> dict[str, int]:
    """Graphs (a recompile adds one), graph breaks, of two training passes over `blocks`, compiled per
    block (sharded first when `shard` is given, as the trainer orders it)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    if shard is not None:
        shard.shard_trained({"net": blocks}, {"net": ("ResnetBlock2D", "BasicTransformerBlock")})
    for block in (blocks.resnet, blocks.attention):
        block.compile(backend="aot_eager")
    draw = torch.Generator().manual_seed(2)
    after_first = 0
    for step in range(2):
        x, temb, text = (torch.randn(2, 32, 4, 4, generator=draw),
                         torch.randn(2, 32, generator=draw), torch.randn(2, 5, 32, generator=draw))
        blocks(x, temb, text).pow(2).mean().backward()
        if step == 0:
            after_first = counters["stats"]["unique_graphs"]
    return {"graphs": counters["stats"]["unique_graphs"],
            "graphs_after_first_pass": counters["stats"]["unique_graphs"] - after_first,
            "graph_breaks": sum(counters["graph_break"].values())}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 10)
        self.outer = nn.Linear(10, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


def sharding_checks(rank: int, world: int) -> dict:
    """What rank 0 reports: the sharded module's clipping against the whole one's, and the
    blocks' compiles sharded and unsharded (every rank runs the same collectives)."""
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
    torch.manual_seed(3)
    unet_blocks = Blocks()
    unsharded = compile_counts(copy.deepcopy(unet_blocks), None)
    sharded_counts = compile_counts(unet_blocks, sharded)
    return {"norm": float(norm), "reference": float(reference),
            "max_clipped_difference": clipped, "local_bytes": local,
            "whole_bytes": sum(p.numel() * p.element_size() for p in whole.parameters()),
            "sharded_blocks": sum(type(m).__name__ == "FSDPBlock" for m in model.modules()),
            "compile_unsharded": unsharded, "compile_sharded": sharded_counts}


def main(train_args: list[str]) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    found = sharding_checks(rank, dist.get_world_size())
    if rank == 0:
        print("sharding checks:", json.dumps(found), flush=True)
    if not train_args:
        dist.destroy_process_group()
        return 0
    from modules.cli.train import main as train  # closes the process group when it ends
    return train(train_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
