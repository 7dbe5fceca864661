"""A sharded (FSDP) run's backup state in the one backup format every run writes.

Under `training.distributed_strategy=FSDP` each process holds its shard of every trained
weight and of the optimizer state (DTensors). A backup gathers each of them whole, one tensor
at a time, onto rank 0's CPU (every process takes part, in the same order: each gather is a
collective) and rank 0 writes the same `backup.json` + `tensors.safetensors` a single process
or DDP writes: parameters by name, the optimizer's own `state_dict` (its integer ids, in
param-group order). So a backup written under FSDP resumes under FSDP, DDP or one process,
and the other way round. Loading, every process reads the whole file and keeps its own shard
of each tensor (cut locally, no communication).

torch.distributed.checkpoint (each rank writing its part) was not chosen: it writes a
different format (one folder of shards per save, keyed by name, read back with its own
planner), so FSDP backups could not be checked, listed, resumed in one process or by DDP as
the others are; gathering costs one whole tensor at a time on each device and the whole state
in rank 0's CPU memory, which a single-process backup costs too (docs/resume.md).
"""
from __future__ import annotations

from typing import Any

import torch


def is_sharded(tensor: object) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(tensor, DTensor)


def gathered(value: Any, keep: bool) -> Any:
    """`value` (a state dict, nested) with each DTensor replaced by its whole value on the CPU.

    A collective: every process calls it with the same structure. Where `keep` is false (the
    processes that do not write) each gathered tensor is dropped at once, so only rank 0 holds
    the whole state; their result is not to be used."""
    if is_sharded(value):
        whole = value.full_tensor()
        return whole.cpu() if keep else None
    if isinstance(value, dict):
        return {key: gathered(item, keep) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(gathered(item, keep) for item in value)
    return value


def shard_of(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This process's shard of `whole` as `like` (a DTensor of the same shape) is sharded, on
    its device and in its dtype: cut from the whole tensor every process holds, so no
    communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    assert isinstance(like, DTensor)
    if tuple(whole.shape) != tuple(like.shape):
        raise ValueError(f"a backup tensor of shape {tuple(whole.shape)} for a weight of shape "
                         f"{tuple(like.shape)}")
    local = whole.to(device=like.to_local().device, dtype=like.dtype)
    return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)


def sharded_optimizer_state(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A whole optimizer `state_dict` (as one process saves it) with each per-weight tensor
    the shape of its weight turned into the shard this process's sharded weight holds, for
    `optimizer.load_state_dict`. Scalars (Adam's step count) stay as they are."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_weight = state.get("state", {})
    out: dict[Any, Any] = {}
    for index, entries in per_weight.items():
        param = params[int(index)]
        out[index] = {key: (shard_of(value, param)
                            if is_sharded(param) and isinstance(value, torch.Tensor)
                            and tuple(value.shape) == tuple(param.shape) else value)
                      for key, value in entries.items()}
    return {**state, "state": out}


def sharded_backup_record(world_size: int) -> dict:
    """run.json's `backups` under FSDP: how the backups were written and what resumes them."""
    return {"sharded_over": world_size, "gathered_to": "rank 0",
            "format": "whole tensors, the format one process or DDP writes",
            "resumes_with": ["FSDP", "DDP", "one process"]}
