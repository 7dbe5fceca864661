"""Block offload for a full fine-tune (issue 58 item 3): the offloaded blocks' trained weights,
their gradients and their optimizer state live on the host; only the block running (and the
one prefetched) has a device copy of its weights.

The streamer (offload.py, `BlockStreamer` with ``trained``) keeps each trained weight's master
copy on the host (pinned on CUDA) and fetches it for the block's forward and again for its
backward, exactly as it does a frozen weight. The fused backward pass (train/recipe/fused.py)
steps each weight as soon as its gradient is accumulated; for an offloaded weight `HostSteps`
makes that step a host one: the gradient (clipped on the device, as every fused gradient is)
is copied to the host, the weight's own optimizer steps the host master with its state on the
host (created there at the first step, restored there from a backup: between steps the
weight *is* its host copy), then the device gradient and the device copy are dropped. The
next fetch reads the updated master. The weights outside the offloaded blocks keep the
optimizer on the device; both use the same per-weight optimizer, hyper-parameters and LR.

On the CPU the "transfer" is a copy (the streamer's), so a run is bit for bit the same run
without offload: the same per-weight optimizer runs on the same values.
"""
from __future__ import annotations

import torch

from modules.train.memory.offload import BlockStreamer


class HostSteps:
    """Which trained weights step on the host, and the step itself (the fused pass's hook
    calls `step` for a weight it `holds`)."""

    def __init__(self, streamer: BlockStreamer):
        self.masters: dict[int, torch.Tensor] = {
            id(param): host for i in streamer.offloaded
            for param, host in streamer.held(i) if param.requires_grad}
        self.stepped = 0  # host steps taken (run.json's record reads it; tests count them)

    def holds(self, param: torch.Tensor) -> bool:
        return id(param) in self.masters

    def step(self, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Step ``optimizer`` (the weight's own) on the host master of ``param`` with its
        gradient copied there; the weight is left pointing at the master, so its device copy
        is freed now, not at the block's eviction (autograd is done with it: the hook runs
        after every use of the weight in this backward has given its gradient)."""
        grad, host = param.grad, self.masters[id(param)]
        assert grad is not None
        param.grad = None  # a gradient must live where its weight does
        param.data = host
        # on CUDA a blocking copy (the fused pass already syncs once per weight for its NaN
        # check); on the CPU the same tensor: the device is the host
        param.grad = grad.to(host.device)
        del grad  # the device gradient: freed when the copy is made
        optimizer.step()
        param.grad = None
        self.stepped += 1

    def record(self) -> dict:
        """What run.json's `block_offload` adds for a full fine-tune."""
        return {"host_optimizer": True, "host_weights": len(self.masters)}
