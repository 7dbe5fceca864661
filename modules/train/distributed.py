"""Multi-process training on Accelerate's process state (launched by `accelerate launch` or torchrun).

Each rank holds a full copy of the model, trains on its own shard of every epoch, and averages
gradients with the others before each optimizer step, so the weights stay identical on every
rank. Rank 0 alone writes files (config, run record, samples, checkpoints, TensorBoard).

Compilation is applied per rank exactly as in a single process (compile, then train: there is no
DDP wrapper for the compiler to see through).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from modules.config.schema import Device


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    backend: str | None = None
    device: torch.device | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (e.g. building a cached model), then the others."""
        if not self.is_main:
            self.barrier()
        try:
            yield
        finally:  # rank 0 releases the others even when it failed (they then fail the same way)
            if self.is_main:
                self.barrier()

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """All-reduce (mean) every gradient, as DDP would after backward."""
        if not self.enabled:
            return
        grads = [p.grad for p in params if p.grad is not None]
        handles = [torch.distributed.all_reduce(g, async_op=True) for g in grads]
        for handle in handles:
            handle.wait()
        for g in grads:
            g.div_(self.world_size)

    def mean(self, value: float) -> float:
        """The mean of a number over all ranks (for the logged loss)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return float(t.item()) / self.world_size

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any (a Stop seen by one rank stops all)."""
        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def gather(self, value: float) -> list[float]:
        if not self.enabled:
            return [value]
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(self.world_size)]
        torch.distributed.all_gather(out, t)
        return [float(x.item()) for x in out]


def launched_distributed() -> bool:
    """True when a launcher (accelerate launch, torchrun) started several processes.

    WORLD_SIZE is the launchers' documented contract with the processes they start.
    """
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(device_setting: Device) -> Distributed:
    """Join the launcher's process group through Accelerate, or run as a single process."""
    if not launched_distributed():
        return Distributed()
    from accelerate import PartialState
    cpu = device_setting == Device.CPU or not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
    return Distributed(state.process_index, state.num_processes, str(state.backend),
                       state.device)


def parameter_checksum(params: list[torch.nn.Parameter]) -> float:
    """A float64 sum over every trained weight: equal on every rank when they are in sync."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in params))
