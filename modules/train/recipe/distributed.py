"""Multi-process training on Accelerate's process state (launched by `accelerate launch` or torchrun).

Each rank holds a full copy of the model and trains on its own shard of every epoch. Each trained
component is wrapped in DistributedDataParallel after it was compiled (compile, then wrap), so
the training step calls the wrapper, which calls the compiled module, and DDP averages the
gradients over the ranks during backward; the weights stay identical on every rank. Rank 0
alone writes files (config, run record, samples, checkpoints, TensorBoard).

The wrappers only route the training forward: the model bundle keeps the unwrapped modules, so
saving, sampling and state-dict keys are the same as in a single process.

With `training.distributed_strategy=FSDP` (a full fine-tune that does not fit one card) each
trained component is sharded instead, with FSDP2's `fully_shard` in the order torch documents:
every repeated block (the REGIONAL compile targets) first, then the component itself, and only
then compiled (`shard_trained` runs before the compile engine) and handed to the optimizer
(sharding replaces the parameters with DTensors). Each process keeps 1/world_size of the trained
weights, their gradients and the optimizer state; a block's weights are gathered for its
forward and backward and freed after. Full weights exist only when saving (`full_state_dict`,
gathered by every process, written by rank 0).
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from modules.config.schema import Device, DistributedStrategy


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    backend: str | None = None
    device: torch.device | None = None
    strategy: DistributedStrategy = DistributedStrategy.DDP

    @property
    def sharded(self) -> bool:
        """FSDP with several processes: the trained weights are split over the ranks."""
        return self.enabled and self.strategy == DistributedStrategy.FSDP

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

    def shard_trained(self, modules: dict[str, nn.Module],
                      blocks: Mapping[str, tuple[str, ...]]) -> list[str]:
        """FSDP: `fully_shard` each trained component's repeated blocks, then the component
        (frozen components stay whole on every rank). Call before compiling and before the
        optimizer is built: the parameters become DTensors. Returns the sharded components."""
        if not self.sharded:
            return []
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from modules.compile.regions import regional_targets
        device_type = self.device.type if self.device is not None else "cpu"
        mesh = init_device_mesh(device_type, (self.world_size,))
        sharded = []
        for name, module in modules.items():
            if not any(p.requires_grad for p in module.parameters()):
                continue
            for block in regional_targets(name, [module], blocks) if name in blocks else []:
                fully_shard(block, mesh=mesh)
            fully_shard(module, mesh=mesh)
            sharded.append(name)
        return sharded

    def wrap_trained(self, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """The modules the training step calls: each trained one in DistributedDataParallel.

        Call after compiling. Text encoders may leave weights unused (SDXL conditions on the
        first encoder's penultimate layer, so its last layer gets no gradient), which DDP must be
        told about; the UNet uses every trained weight, and skipping the search saves a graph
        walk per step. Buffers (position ids) never change, so they are not re-broadcast.
        """
        if not self.enabled or self.sharded:  # FSDP modules are their own wrappers
            return dict(modules)
        from torch.nn.parallel import DistributedDataParallel
        device = self.device
        device_ids = [device.index] if device is not None and device.type == "cuda" else None
        wrapped: dict[str, nn.Module] = {}
        for name, module in modules.items():
            if not any(p.requires_grad for p in module.parameters()):
                wrapped[name] = module
                continue
            wrapped[name] = DistributedDataParallel(
                module, device_ids=device_ids, broadcast_buffers=False,
                find_unused_parameters=name.startswith("text_encoder"))
        return wrapped

    @contextlib.contextmanager
    def gradient_sync(self, modules: dict[str, nn.Module], sync: bool):
        """Skip DDP's gradient exchange on micro-batches that do not close an accumulation
        window (the gradients accumulate locally and are averaged once, on the closing one).

        FSDP components sync on every micro-batch, on purpose: its counterpart of no_sync,
        `set_requires_gradient_sync(False)`, keeps every block's gradients unsharded on every
        rank until the window closes, a whole model's gradients per process, which is what
        sharding is there to avoid. Reduce-scattering each micro-batch keeps only the shard
        (the sum over the window is the same up to the order of the float additions)."""
        with contextlib.ExitStack() as stack:
            if not sync:
                from torch.nn.parallel import DistributedDataParallel
                for module in modules.values():
                    if isinstance(module, DistributedDataParallel):  # wrap_trained's wrappers
                        stack.enter_context(module.no_sync())
            yield

    def close(self) -> None:
        """Leave the launcher's process group (destroy it in this process), once the run is
        over, however it ended.

        Left to the interpreter's exit, the group is torn down while Python is finalizing:
        gloo's worker threads can still hold work objects whose tensors reference Python, and
        destroying them then aborts the process (`terminate called without an active
        exception`, exit -6 under torchrun) after a run that finished. torch registers no exit
        hook for this (pytorch/pytorch#179291 proposed one), so the run closes its own group.
        """
        if self.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

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

    def any_of(self, *flags: bool) -> tuple[bool, ...]:
        """`any` of several flags at once, in one all-reduce."""
        if not self.enabled:
            return flags
        t = torch.tensor([1.0 if flag else 0.0 for flag in flags], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return tuple(bool(x) for x in t.tolist())

    def from_main(self, value: object) -> object:
        """Rank 0's `value` on every rank (one broadcast of a small picklable value): what
        only rank 0 knew, such as how its write went."""
        if not self.enabled:
            return value
        box = [value if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

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


def launcher_command(program: str) -> list[str] | None:
    """The command line that started this process's launcher, up to and including `program`
    (this process's sys.argv[0]) as the launcher was given it, e.g. `torchrun
    --nproc_per_node 2 --master_port 29500 scripts/train.py`; None when no launcher started
    several processes, or where its command line cannot be read (Linux's /proc only).

    A command printed to start this run again must keep it: the same program without it runs
    one process, at 1/world_size of the effective batch. torchrun and `accelerate launch`
    start each process themselves (the parent); the environment they set (WORLD_SIZE,
    LOCAL_WORLD_SIZE) says how many, but not the options they were given."""
    if not launched_distributed():
        return None
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return launcher_words([word.decode(errors="replace") for word in raw.split(b"\0") if word],
                          program)


def launcher_record() -> str:
    """run.json's `launcher`: the launcher's command up to the program (`launcher_command`),
    shell-quoted, or why it is not known."""
    words = launcher_command(sys.argv[0]) if sys.argv and sys.argv[0] else None
    return shlex.join(words) if words else "not known: the launcher's command line could not be read"


def launcher_words(parent: list[str], program: str) -> list[str] | None:
    """`launcher_command` from the launcher's argv (`parent`): its words up to `program`
    (matched by name), with a console script run by its interpreter (`python .../torchrun`,
    as the kernel starts a script with a #! line) written as the shell finds it."""
    name = Path(program).name
    found = next((i for i, word in enumerate(parent) if i and Path(word).name == name), None)
    if found is None:
        return None
    words = parent[:found + 1]
    if Path(words[0]).name.startswith("python") and not words[1].startswith("-"):
        words = [shell_name(words[1]), *words[2:]]  # a console script (torchrun, accelerate)
    elif Path(words[0]).name.startswith("python"):
        words = [shell_name(words[0]), *words[1:]]  # python -m torch.distributed.run
    return words


def shell_name(path: str) -> str:
    """`path`'s bare name when the shell finds that very file by it, else the path."""
    found = shutil.which(Path(path).name)
    same = found is not None and Path(found).resolve() == Path(path).resolve()
    return Path(path).name if same else path


def init_distributed(device_setting: Device,
                     strategy: DistributedStrategy = DistributedStrategy.DDP) -> Distributed:
    """Join the launcher's process group through Accelerate, or run as a single process."""
    if not launched_distributed():
        return Distributed(strategy=strategy)
    from accelerate import PartialState
    cpu = device_setting == Device.CPU or not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
    return Distributed(state.process_index, state.num_processes, str(state.backend),
                       state.device, strategy)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank calls it); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def clip_sharded_gradients(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """FSDP's gradient clipping: the total norm over every rank's gradient shards (the norm
    one process holding the whole gradients gets; a collective), and each shard scaled by the
    same factor when `max_norm` is set. Returns the norm as a plain tensor."""
    norm = full_tensor(torch.nn.utils.get_total_norm(
        [p.grad for p in params if p.grad is not None]))
    if max_norm:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def parameter_checksum(params: list[torch.nn.Parameter]) -> float:
    """A float64 sum over every trained weight: equal on every rank when they are in sync.
    Sharded (FSDP) weights are summed whole, so every rank must call it."""
    if not params:
        return 0.0
    with torch.no_grad():  # summed on the device, read once
        return float(torch.stack([full_tensor(p.detach()).double().sum()
                                  for p in params]).sum().item())
