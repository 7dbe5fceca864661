"""Block offload (`model.offload_blocks`, issue 46 item 2): some of the denoiser's repeated blocks
(the ones REGIONAL compile compiles) kept in (pinned, on CUDA) CPU memory and streamed to the
device ahead of their use, in forward and in backward, for LoRA training.

Two parts:
- the schedule, pure data: `choose_blocks` (which blocks: the largest first, so a given count
  saves the most) and `stream_schedule` (when each is fetched, prefetched and evicted in forward
  and in backward, with a look-ahead of one offloaded block);
- the mechanism, `BlockStreamer`: an `OuterCall` around each offloaded block's call
  (compile/outer.py), so the transfers run outside the block's compiled code and REGIONAL
  compile keeps every block compiled. Before a block runs, its weights are made resident (from
  the prefetch, else fetched now) and the next offloaded block is prefetched on a side CUDA
  stream; after its forward the device copy is dropped (the weights are frozen: nothing is
  copied back). Autograd saved the parameters themselves, whose storage is swapped back in
  before the block's backward runs: a hook on the block's output gradient fetches the block
  (and prefetches the next one backward) and evicts the block whose backward came before.
  With gradient checkpointing the re-run forward happens inside that window, block resident.

Only frozen parameters move: a LoRA's trainable weights inside a block stay on the device, and
so do buffers (W8A8's `weight_scale`, 4 bytes an output row, is one). A frozen weight stored in 8
bits (`model.weight_storage`) moves as stored: W8A8's int8 values are a plain tensor, torchao's
INT8 / FLOAT8 weights are tensor subclasses whose values and scales are inner tensors (`_remap`,
`_put`: `.data =` alone would swap only the subclass's empty wrapper). The device is a
parameter: on the CPU the "transfer" is a copy into new storage, so the swap is
observable (the weights' data_ptr changes) and a run is bit-for-bit the run without offload.
A full fine-tune's offload (``trained``, issue 58 item 3) moves the trained weights too:
the fused backward pass steps them on their host copies (offload_trained.py), so dropping
the device copy at eviction is still all there is to do.
What only a GPU shows (the overlap of copies with compute, the speed, the peak memory) is the
GPU validation phase's measurement (docs/gpu.md).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from modules.compile.outer import OuterCall, install_outer_call, remove_outer_call
from modules.compile.regions import regional_targets
from modules.models.weight_storage import stored_bytes


@dataclass(frozen=True)
class StreamEvent:
    """One thing the streamer did: ``action`` (fetch | prefetch | evict) on ``block`` (its index
    among the denoiser's repeated blocks, module order) at ``point`` (before | after a block, or
    end) of ``phase`` (forward | backward)."""
    phase: str
    point: str
    at: int  # the block whose call (or backward) marks the point; -1 at the end
    action: str
    block: int


def choose_blocks(block_bytes: Sequence[int], count: int) -> list[int]:
    """The ``count`` blocks to offload: the largest weights first (ties: the earlier block), so a
    given count saves the most device memory. Indices in module order, sorted."""
    ranked = sorted(range(len(block_bytes)), key=lambda i: (-block_bytes[i], i))
    return sorted(ranked[:count])


def in_flight_bytes(block_bytes: Sequence[int], offloaded: Collection[int]) -> int:
    """The most device memory offloaded blocks take at once: the one running and the one being
    prefetched (a look-ahead of one), at most the two largest."""
    sizes = sorted((block_bytes[i] for i in offloaded), reverse=True)
    return sum(sizes[:2])


def stream_schedule(order: Sequence[int], offloaded: Collection[int],
                    backward: Collection[int]) -> list[StreamEvent]:
    """What one micro-step does: ``order`` is the blocks' forward call order, ``backward`` the
    blocks that take part in backward (their output needs a gradient). Forward: the first
    offloaded block is fetched before it runs, every offloaded block prefetches the next one
    before it runs and is evicted after it. Backward (reverse order): the same, except that a
    block is evicted when the next backward block starts (autograd gives no hook at the end of a
    block's backward); the last one at the end."""
    events: list[StreamEvent] = []
    forward = [b for b in order if b in offloaded]
    _phase(events, "forward", forward, evict_after=True)
    back = [b for b in reversed(order) if b in offloaded and b in backward]
    _phase(events, "backward", back, evict_after=False)
    if back:
        events.append(StreamEvent("backward", "end", -1, "evict", back[-1]))
    return events


def _phase(events: list[StreamEvent], phase: str, blocks: list[int], evict_after: bool) -> None:
    for k, block in enumerate(blocks):
        if not evict_after and k:
            events.append(StreamEvent(phase, "before", block, "evict", blocks[k - 1]))
        if k == 0:
            events.append(StreamEvent(phase, "before", block, "fetch", block))
        if k + 1 < len(blocks):
            events.append(StreamEvent(phase, "before", block, "prefetch", blocks[k + 1]))
        if evict_after:
            events.append(StreamEvent(phase, "after", block, "evict", block))


def _remap(tensor: torch.Tensor, change: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``tensor`` with ``change`` applied to what holds its values: the tensor itself, or each
    inner tensor of a tensor subclass (torchao's INT8 / FLOAT8 weights: qdata, scale, zero
    point), rebuilt as the same subclass. torchao implements no `pin_memory` for its tensors,
    and its `.to` / `clone` would be one call per subclass anyway."""
    if not is_traceable_wrapper_subclass(tensor):
        return change(tensor)
    names, context = tensor.__tensor_flatten__()
    inner = {name: _remap(getattr(tensor, name), change) for name in names}
    return type(tensor).__tensor_unflatten__(inner, context, tensor.size(), tensor.stride())


def _inner(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s values (itself, or a subclass's inner ones)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    return [t for name in tensor.__tensor_flatten__()[0] for t in _inner(getattr(tensor, name))]


def storage_pointers(tensor: torch.Tensor) -> list[int]:
    """Where ``tensor``'s values are (a subclass's `data_ptr` is 0: its inner tensors' are)."""
    return [t.data_ptr() for t in _inner(tensor)]


def _put(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``param`` hold ``value``'s values (same shape and kind), keeping the parameter
    object that modules, autograd and compiled code know. For a tensor subclass, `.data =`
    swaps only the wrapper (its device, shape, dtype) and the values are the inner tensors,
    plain Python attributes of the parameter: those are set too."""
    param.data = value
    if is_traceable_wrapper_subclass(param):
        for name in param.__tensor_flatten__()[0]:
            setattr(param, name, getattr(value, name))


def block_bytes(block: nn.Module, trained: bool = False) -> int:
    """Bytes of what offloading a block moves off the device: its frozen parameters, and with
    ``trained`` (a full fine-tune's offload, offload_trained.py) its trained ones too."""
    return sum(stored_bytes(p) for p in moved_parameters(block, trained))


def moved_parameters(block: nn.Module, trained: bool) -> list[nn.Parameter]:
    """The parameters offload keeps on the host: the frozen ones (a LoRA's adapters stay on the
    device), every one with ``trained``."""
    return [p for p in block.parameters() if trained or not p.requires_grad]


def denoiser_blocks(denoiser: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """The denoiser's repeated blocks, module order (the ones REGIONAL compile compiles)."""
    return regional_targets("denoiser", [denoiser], {"denoiser": names})


def offload_saving(denoiser: nn.Module, names: tuple[str, ...], count: int,
                   trained: bool = False) -> tuple[int, int, int]:
    """(blocks offloaded, their bytes, the in-flight bytes) for ``count`` on ``denoiser``: the
    memory plan's figures, from the same choice the streamer makes (meta tensors do)."""
    sizes = [block_bytes(b, trained) for b in denoiser_blocks(denoiser, names)]
    chosen = choose_blocks(sizes, min(count, len(sizes)))
    return len(chosen), sum(sizes[i] for i in chosen), in_flight_bytes(sizes, chosen)


class _BlockCall(OuterCall):
    """An offloaded block's call: the streamer's work around it."""

    def __init__(self, module: nn.Module, streamer: BlockStreamer, index: int):
        super().__init__(module)
        self.streamer, self.index = streamer, index

    def around(self, *args: Any, **kwargs: Any) -> Any:
        return self.streamer.run_block(self, args, kwargs)


class BlockStreamer:
    """Keeps the chosen blocks' frozen weights on the host and streams them to ``device``; with
    ``trained`` their trained weights too, whose optimizer steps on the host copies
    (offload_trained.py)."""

    def __init__(self, blocks: Sequence[nn.Module], offloaded: Collection[int],
                 device: torch.device, trained: bool = False):
        self.blocks = list(blocks)
        self.trained = trained
        self.offloaded = sorted(offloaded)
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.order: list[int] = list(self.offloaded)  # forward call order, learned each step
        self.backward_blocks: set[int] = set()
        self.log: list[StreamEvent] = []  # this micro-step's events
        self.phase = "forward"
        self._calls: list[int] = []
        self._host: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        self._pending: dict[int, tuple[list[torch.Tensor], Any]] = {}
        self._resident: set[int] = set()
        self._back_current: int | None = None
        for i in self.offloaded:
            self._host[i] = [(p, self._host_copy(p.data)) for p in self._frozen(i)]
            install_outer_call(self.blocks[i], _BlockCall(self.blocks[i], self, i))
        self._drop_all()

    # ------------------------------------------------------------------ the hosts' copies
    def _frozen(self, i: int) -> list[nn.Parameter]:
        return moved_parameters(self.blocks[i], self.trained)

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu" and not self.cuda:
            return tensor  # already the host copy
        host = _remap(tensor.detach(), lambda t: t.to("cpu"))
        return _remap(host, torch.Tensor.pin_memory) if self.cuda else host

    def host_tensors(self, i: int) -> list[torch.Tensor]:
        """Block ``i``'s host copies (their storage is what an offloaded block points at)."""
        return [host for _, host in self._host[i]]

    def held(self, i: int) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Block ``i``'s moved parameters, each with its host copy."""
        return list(self._host[i])

    def resident(self) -> set[int]:
        """The offloaded blocks whose weights are on the device now."""
        return set(self._resident)

    def _drop_all(self) -> None:
        for i in self.offloaded:
            for param, host in self._host[i]:
                _put(param, host)
        self._resident.clear()
        self._pending.clear()

    # ------------------------------------------------------------------ transfers
    def _copy(self, i: int) -> list[torch.Tensor]:
        if self.cuda:
            return [_remap(host, lambda t: t.to(self.device, non_blocking=True))
                    for _, host in self._host[i]]
        return [_remap(host, torch.clone) for _, host in self._host[i]]  # new storage: it shows

    def _prefetch(self, i: int, phase: str, point: str, at: int) -> None:
        if i in self._resident or i in self._pending:
            return
        self.log.append(StreamEvent(phase, point, at, "prefetch", i))
        if self.stream is None:
            self._pending[i] = (self._copy(i), None)
            return
        # the side stream waits for compute so far: memory freed by an eviction is reused only
        # once the kernels that read it have run
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copies = self._copy(i)
            done = self.stream.record_event()
        self._pending[i] = (copies, done)

    def _make_resident(self, i: int, phase: str, at: int) -> None:
        if i in self._resident:
            return
        if i in self._pending:
            copies, done = self._pending.pop(i)
        else:
            self.log.append(StreamEvent(phase, "before", at, "fetch", i))
            copies, done = self._copy(i), None
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for copy in copies:
                for held in _inner(copy):
                    held.record_stream(current)  # made on the side stream, used on compute
        for (param, _), copy in zip(self._host[i], copies):
            _put(param, copy)
        self._resident.add(i)

    def _evict(self, i: int, phase: str, point: str, at: int) -> None:
        self.log.append(StreamEvent(phase, point, at, "evict", i))
        for param, host in self._host[i]:
            _put(param, host)  # frozen: dropping the device copy is all
        self._resident.discard(i)

    def _next(self, sequence: list[int], i: int) -> int | None:
        if i not in sequence:
            return None
        k = sequence.index(i)
        return sequence[k + 1] if k + 1 < len(sequence) else None

    # ------------------------------------------------------------------ the step
    def begin(self) -> None:
        """Before a micro-step's forward (after one that raised, too: all offloaded again)."""
        self._drop_all()
        self.log, self._calls, self.phase = [], [], "forward"
        self.backward_blocks, self._back_current = set(), None

    def run_block(self, call: _BlockCall, args: tuple, kwargs: dict) -> Any:
        i = call.index
        if self.phase == "backward":  # gradient checkpointing's re-run: the block is resident
            self._make_resident(i, "backward", i)
            return call.call(*args, **kwargs)
        self._calls.append(i)
        self._make_resident(i, "forward", i)
        following = self._next(self.order, i)
        if following is not None:
            self._prefetch(following, "forward", "before", i)
        output = call.call(*args, **kwargs)
        self._evict(i, "forward", "after", i)
        first = output[0] if isinstance(output, tuple) else output
        if isinstance(first, torch.Tensor) and first.requires_grad:
            self.backward_blocks.add(i)
            first.register_hook(lambda grad, i=i: self._backward_reached(i))
        return output

    def _backward_reached(self, i: int) -> None:
        """Block ``i``'s output gradient is ready: its backward comes next."""
        self.phase = "backward"
        if self._back_current is not None and self._back_current != i:
            self._evict(self._back_current, "backward", "before", i)
        self._back_current = i
        self._make_resident(i, "backward", i)
        back = [b for b in reversed(self._calls) if b in self.backward_blocks]
        following = self._next(back, i)
        if following is not None:
            self._prefetch(following, "backward", "before", i)

    def end(self) -> None:
        """After a micro-step's backward (or a forward without one): nothing stays resident."""
        if self._back_current is not None:
            self._evict(self._back_current, "backward", "end", -1)
        for i in sorted(self._resident | set(self._pending)):
            self._evict(i, self.phase, "end", -1)
        self._drop_all()
        if self._calls:  # the order the next step prefetches in
            self.order = list(dict.fromkeys(self._calls))
        self.phase, self._back_current = "forward", None

    @contextmanager
    def aside(self) -> Iterator[None]:
        """A pass outside training (sampling, validation: forwards without backward), streamed
        as a step of its own: it starts with everything offloaded, leaves nothing resident
        (also when it raises in the middle of a forward), and the next training step prefetches
        in the order training learned, not the pass's (a pass cut short calls fewer blocks).
        ``log`` holds the pass's events until the next step begins."""
        order = list(self.order)
        self.begin()
        try:
            yield
        finally:
            self.end()
            self.order, self._calls = order, []

    def close(self) -> None:
        """Every block's weights back on the device and its call as it was."""
        for i in self.offloaded:
            for param, host in self._host[i]:
                _put(param, _remap(host, lambda t: t.to(self.device)))
            remove_outer_call(self.blocks[i])
        self._host.clear()

    def record(self) -> dict[str, Any]:
        """run.json's `block_offload`."""
        sizes = [block_bytes(b, self.trained) for b in self.blocks]
        moved = sum(sizes[i] for i in self.offloaded)
        return {"blocks": len(self.offloaded), "of": len(self.blocks),
                "trained_weights": self.trained,
                "offloaded": [f"{i}:{type(self.blocks[i]).__name__}" for i in self.offloaded],
                "offloaded_bytes": moved,
                "in_flight_bytes": in_flight_bytes(sizes, self.offloaded),
                "pinned": self.cuda, "side_stream": self.cuda}


class OffloadChoice(NamedTuple):
    """The denoiser's repeated blocks and the indices of those `model.offload_blocks` offloads:
    made once at setup, read by `held_on_host` (the load) and `build_streamer` (the steps);
    ``trained``: their trained weights move too (a full fine-tune, offload_trained.py)."""
    blocks: list[nn.Module]
    chosen: list[int]
    trained: bool = False


def offload_choice(denoiser: nn.Module, names: tuple[str, ...],
                   count: int, trained: bool = False) -> OffloadChoice | None:
    """The ``count`` largest of the denoiser's repeated blocks (None when ``count`` is 0)."""
    if count <= 0:
        return None
    blocks = denoiser_blocks(denoiser, names)
    return OffloadChoice(blocks, choose_blocks([block_bytes(b, trained) for b in blocks],
                                               min(count, len(blocks))), trained)


@contextmanager
def held_on_host(choice: OffloadChoice | None) -> Iterator[None]:
    """Inside, moving the denoiser to the device leaves the frozen weights of the chosen blocks
    (a full fine-tune's trained ones too) where they are (CPU memory), so loading never holds the whole denoiser on the device: those
    weights stand in as empty tensors while the rest moves (their LoRA weights and buffers move
    as usual), and are put back after. `build_streamer` then takes them as its host copies."""
    if choice is None:
        yield
        return
    kept = [(p, p.data) for i in choice.chosen
            for p in moved_parameters(choice.blocks[i], choice.trained)]
    for param, data in kept:  # a subclass's stand-in is one of its kind with empty inner tensors
        _put(param, _remap(data, lambda t: t.new_empty((0,) * t.dim())))
    try:
        yield
    finally:
        for param, data in kept:
            _put(param, data)


def build_streamer(choice: OffloadChoice | None, device: torch.device) -> BlockStreamer | None:
    """The streamer for the chosen blocks (None when block offload is off)."""
    if choice is None:
        return None
    return BlockStreamer(choice.blocks, choice.chosen, device, choice.trained)
