"""The GPU memory plan: a lower bound of the device memory a run needs before its first
activation, itemised, so that a run that cannot fit is refused before anything is loaded onto
the GPU (issue 31), and run.json can set the plan beside the measured peak.

What it counts is what the trainer keeps on the device for the whole run: every component's
weights, except those that stay on the CPU because their outputs are cached (the text
encoders with cached captions, the VAE with cached latents: train/recipe/placement.py),
the trained weights' gradients, the optimizer's state (modules/config/optimizers.py `state`),
the EMA copy, and DistributedDataParallel's gradient buckets when several processes train.
What it does not count: activations (they depend on resolution, batch size, gradient
checkpointing and what the compiler fuses), the compiler's and cuDNN's workspaces, CUDA graph
pools, the optimizer's temporaries while it steps, the CUDA context, and fragmentation.

The plan is computed on weightless copies of the components (PyTorch's meta device, built
from the model's config files), with the same `prepare_trainable` the run uses, so a LoRA's
adapters are counted exactly as peft adds them, and the plan costs no memory and no load.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modules.config.adapters import ADAPTERS
from modules.config.optimizers import OPTIMIZERS, OptimizerRow
from modules.config.schema import (Config, DistributedStrategy, ModelType, Optimizer,
                                   TrainingMethod)
from modules.model_types import MODEL_TYPES
from modules.models.bundle import ModelBundle
from modules.models.families import family_of
from modules.models.sd_folder import component_classes
from modules.models.weight_storage import stored_bytes, stored_format, stored_tensors
from modules.train.recipe.placement import components_off_device

GIB = 2 ** 30
WARN_FRACTION = 0.9  # above this share of the card, activations will likely not fit
NOT_COUNTED = ("a lower bound: activations, compiler and cuDNN workspaces, CUDA graph pools, "
               "the optimizer's temporaries and the CUDA context are not counted")
DTYPE_LABELS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps smaller tensors' state in float32
BNB_BLOCK = 256           # elements per float32 scale in its blockwise 8-bit state


@dataclass(frozen=True)
class MemoryPlan:
    """Device bytes a run needs before activations, as (what, bytes) lines."""
    lines: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(size for _, size in self.lines)

    def describe(self) -> list[str]:
        """One line per item, then the total: what `--check` prints."""
        return [f"{what}: {gib(size)}" for what, size in self.lines] + [
            f"total: {gib(self.total)} ({NOT_COUNTED})"]

    def record(self) -> dict:
        """run.json's `memory_plan`, in bytes (compare with memory.peak_allocated_bytes)."""
        return {"total_bytes": self.total,
                "lines": [{"what": what, "bytes": size} for what, size in self.lines],
                "counts": NOT_COUNTED}


def gib(size: int) -> str:
    """A size for people: GiB with two decimals, MiB or KiB below one GiB (the unit by the
    magnitude: a difference below zero reads -1.50 GiB, not millions of KiB)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20)):
        if abs(size) >= scale:
            return f"{size / scale:,.2f} {unit}"
    return f"{size / 2 ** 10:,.1f} KiB"


# ------------------------------------------------------------------- optimizer state, in bytes
def state_bytes(kind: str, shape: Sequence[int], element_size: int) -> int:
    """Bytes of one optimizer state tensor of `kind` (optimizers.STATE_KINDS) for one weight."""
    numel = math.prod(shape)
    factored = len(shape) >= 2
    vectors = (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) if factored else 0
    if kind == "copy":
        return numel * element_size
    if kind == "bf16_copy":
        return numel * 2
    if kind == "factored":
        return (vectors if factored else numel) * element_size
    if kind == "factored_only":
        return vectors * element_size
    if kind == "8bit":
        if numel < BNB_MIN_8BIT_SIZE:
            return numel * 4
        return numel + math.ceil(numel / BNB_BLOCK) * 4
    raise ValueError(f"unknown optimizer state kind {kind!r}")


def optimizer_state_bytes(optimizer: Optimizer, params: Iterable[torch.Tensor]) -> int:
    """Bytes of the optimizer's state for these trained weights (the one place this is
    computed: the memory plan and the backup's size both ask it)."""
    kinds = OPTIMIZERS[optimizer].state
    return sum(state_bytes(kind, tuple(p.shape), p.element_size())
               for p in params for kind in kinds)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the tensors hold (a weight stored in 8 bits: 1 byte a value plus its scales)."""
    return sum(stored_bytes(t) for t in tensors)


def stored_line(name: str, stored: list[torch.Tensor]) -> str:
    """The plan's line for a component's weights stored in 8 bits (`model.weight_storage`)."""
    weights = [t for t in stored if stored_format(t)]  # not W8A8's scales, held beside them
    found = stored_format(weights[0])
    assert found is not None  # only stored weights reach here
    return (f"{name} linear weights stored as {found.word} ({sum(t.numel() for t in weights):,} "
            f"values: {found.layout})")


# -------------------------------------------------------------- the plan on weightless copies
def config_folders(config: Config, model_path: Path) -> Path:
    """The folder whose <component>/config.json files describe the model: the diffusers folder
    itself, or for a single file the configs it is loaded with (model.config_path, else the
    shipped ones)."""
    from modules.models.families import family_files
    from modules.models.single_file import config_folder_for, is_single_file
    if not is_single_file(model_path):
        return Path(model_path)
    return Path(config.model.config_path) if config.model.config_path \
        else config_folder_for(family_files(config.model.type), model_path)


def component_class(folder: Path, name: str, model_type: ModelType) -> Any:
    """The class a component's config.json names (diffusers' `_class_name`, transformers'
    `architectures`), so any family's components are built as their files say; else the one
    the SD loader builds it as."""
    import diffusers
    import transformers
    data = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if data.get("_class_name"):
        return getattr(diffusers, data["_class_name"])
    if data.get("architectures"):
        return getattr(transformers, data["architectures"][0])
    return component_classes(model_type)[name]


def weightless_bundle(config: Config, model_path: Path) -> ModelBundle:
    """The model's components on the meta device (shapes, no memory), from their configs."""
    from modules.train.recipe.trainable import component_dtypes
    folder = config_folders(config, model_path)
    dtypes = component_dtypes(config)
    modules: dict[str, Any] = {}  # diffusers and transformers models, as their files name them
    with torch.device("meta"):
        for name in MODEL_TYPES[config.model.type].components:
            cls = component_class(folder / name, name, config.model.type)
            if hasattr(cls, "load_config"):  # diffusers
                modules[name] = cls.from_config(cls.load_config(folder / name))
            else:  # transformers
                modules[name] = cls(cls.config_class.from_pretrained(folder / name))
            # at the dtype it is loaded at; nn.Module.to, as diffusers' own `to` warns about
            # casting a loaded model (there is nothing loaded here to round)
            nn.Module.to(modules[name], dtype=dtypes[name])
    spec = MODEL_TYPES[config.model.type]
    return ModelBundle(config.model.type, Path(model_path), modules[spec.denoiser],
                       modules["vae"], {n: modules[n] for n in spec.text_encoders}, {}, None)


def weightless_trainable(config: Config, model_path: Path
                         ) -> tuple[ModelBundle, dict[str, list[nn.Parameter]]]:
    """The weightless bundle made trainable as the run makes the real one (adapters, dtypes),
    and its trained parameters."""
    from modules.train.recipe.trainable import prepare_trainable
    bundle = weightless_bundle(config, model_path)
    return bundle, prepare_trainable(bundle, config)


def plan_memory(config: Config, model_path: Path, distributed: bool = False) -> MemoryPlan:
    """The memory plan of `config` on the model at `model_path` (nothing is loaded)."""
    return plan_from(config, *weightless_trainable(config, model_path), distributed)


def plan_from(config: Config, bundle: ModelBundle, params: dict[str, list[nn.Parameter]],
              distributed: bool = False, processes: int | None = None) -> MemoryPlan:
    """The plan's lines for a bundle whose trained parameters are `params` (meta or real);
    `processes`: how many processes a distributed run has (default: this launch's)."""
    trained_ids = {id(p) for plist in params.values() for p in plist}
    trained = [p for plist in params.values() for p in plist]
    what = {TrainingMethod.FINE_TUNE: "trained weights",
            TrainingMethod.TEXTUAL_INVERSION: "token embeddings (trained whole, new rows kept)",
            }.get(config.training.method, f"{ADAPTERS[config.training.adapter].label} adapters")
    lines: list[tuple[str, int]] = []
    off = components_off_device(config)
    for name, module in bundle.components().items():
        frozen = [t for t in [*module.parameters(), *module.buffers()] if id(t) not in trained_ids]
        held = {id(t) for t in stored_tensors(module)}
        stored = [t for t in frozen if id(t) in held]
        frozen = [t for t in frozen if id(t) not in held]
        if (frozen or stored) and name in off:
            # kept on the CPU (train/recipe/placement.py): on the device only while its
            # outputs are cached, before training, and for the passes that borrow it
            alone = frozen + stored
            lines.append((f"{name} weights ({describe_tensors(alone)}; on the CPU: "
                          f"{gib(tensor_bytes(alone))} on the device only while its outputs "
                          f"are cached, before training; back on it: {off[name][1]})", 0))
            stored = []
        elif frozen:
            lines.append((f"{name} weights ({describe_tensors(frozen)})", tensor_bytes(frozen)))
        if stored:  # model.weight_storage FLOAT8, INT8 or W8A8
            lines.append((stored_line(name, stored), tensor_bytes(stored)))
        if name == bundle.denoiser_name and config.model.offload_blocks:
            lines.append(offload_line(config, module))
        if params.get(name):
            lines.append((f"{name} {what} ({describe_tensors(params[name])})",
                          tensor_bytes(params[name])))
    shards = fsdp_shards(config, distributed, processes)
    if shards > 1:  # FSDP: each process holds its shard of what is trained
        return MemoryPlan(tuple(sharded_lines(config, bundle, params, lines, shards)))
    lines.append(gradients_line(config, trained))
    row = OPTIMIZERS[config.training.optimizer]
    lines.append((optimizer_state_label(row),
                  optimizer_state_bytes(config.training.optimizer, trained)))
    if config.training.ema:
        lines.append(("EMA copy of the trained weights", tensor_bytes(trained)))
    if config.training.method == TrainingMethod.TEXTUAL_INVERSION:
        # train/recipe/textual_inversion.py: keep_old_rows copies the rows back after each step
        lines.append(("copy of the token embeddings' old rows", tensor_bytes(trained)))
    if distributed:  # DDP's buckets are a flat copy of the gradients it all-reduces
        lines.append(("DistributedDataParallel gradient buckets", tensor_bytes(trained)))
    return MemoryPlan(tuple(lines))


# how the plan's optimizer line names each kind of state (config/optimizers.py STATE_KINDS):
# one of it, several of it
STATE_WORDS = {
    "copy": ("a copy", "copies"),
    "bf16_copy": ("a bfloat16 copy", "bfloat16 copies"),
    "8bit": ("an 8-bit copy", "8-bit copies"),
    "factored": ("row and column factors", "sets of row and column factors"),
    "factored_only": ("row and column factors (none for a 1-D weight)",
                      "sets of row and column factors (none for a 1-D weight)"),
}


def optimizer_state_label(row: OptimizerRow) -> str:
    """The optimizer line's label, its state in words: "optimizer state (AdamW: 2 copies of
    each weight)", "(Adafactor (fixed learning rate): a bfloat16 copy and row and column
    factors of each weight)"."""
    counts: dict[str, int] = {}
    for kind in row.state:
        counts[kind] = counts.get(kind, 0) + 1
    parts = [STATE_WORDS[kind][0] if n == 1 else f"{n} {STATE_WORDS[kind][1]}"
             for kind, n in counts.items()]
    words = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    return f"optimizer state ({row.label}: {words} of each weight)"


def fsdp_shards(config: Config, distributed: bool, processes: int | None = None) -> int:
    """How many processes FSDP shards the trained weights over (1: not sharded): `processes`,
    else this launch's. WORLD_SIZE is the launchers' contract with the processes they start
    (train/recipe/distributed.py)."""
    if (not distributed or config.training.distributed_strategy != DistributedStrategy.FSDP
            or config.training.method != TrainingMethod.FINE_TUNE):  # FSDP refuses adapters
        return 1
    return max(1, processes or int(os.environ.get("WORLD_SIZE", "1")))


def shard_of(tensor: torch.Tensor, shards: int) -> torch.Tensor:
    """A meta tensor of the shape FSDP2 gives rank 0's shard of `tensor` (dim 0 split in
    `shards` chunks, the first ones the largest): the most any rank holds."""
    if tensor.dim() == 0:
        return torch.empty((), dtype=tensor.dtype, device="meta")
    rows = -(-tensor.shape[0] // shards)
    return torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device="meta")


def sharded_lines(config: Config, bundle: ModelBundle, params: dict[str, list[nn.Parameter]],
                  lines: list[tuple[str, int]], shards: int) -> list[tuple[str, int]]:
    """`lines` with the trained weights, their gradients and the optimizer state divided over
    `shards` processes (FSDP), plus what is gathered whole while it runs: the trained
    component's own weights outside its repeated blocks (the root stays gathered through
    the forward) and the largest block twice (the one running and the next, prefetched)."""
    from modules.compile.regions import regional_targets
    from modules.train.recipe.compile_guard import component_blocks
    trained = [p for plist in params.values() for p in plist]
    local = [shard_of(p, shards) for p in trained]
    out = []
    for label, size in lines:
        name = next((n for n in params if label.startswith(f"{n} ") and params[n]), None)
        if name is not None and size == tensor_bytes(params[name]):
            own = [shard_of(p, shards) for p in params[name]]
            label = f"{label}, sharded over {shards} processes (FSDP)"
            size = tensor_bytes(own)
        out.append((label, size))
    out.append((f"gradients of the trained weights, sharded over {shards} processes",
                tensor_bytes(local)))
    row = OPTIMIZERS[config.training.optimizer]
    out.append((f"{optimizer_state_label(row)}, sharded over {shards} processes",
                optimizer_state_bytes(config.training.optimizer, local)))
    blocks = component_blocks(bundle)
    in_flight = 0
    for name, plist in params.items():
        if not plist:
            continue
        module = bundle.component(name)
        found = regional_targets(name, [module], blocks) if name in blocks else []
        sizes = [tensor_bytes([p for p in b.parameters() if p.requires_grad]) for b in found]
        in_block = {id(p) for b in found for p in b.parameters()}
        root = tensor_bytes([p for p in plist if id(p) not in in_block])
        in_flight = max(in_flight, root + 2 * max(sizes, default=0))
    out.append(("gathered whole while they run (FSDP): the component's weights outside its "
                "blocks and its largest block twice (running and prefetched)", in_flight))
    return out


def gradients_line(config: Config, trained: Sequence[torch.Tensor]) -> tuple[str, int]:
    """The gradients' line. Under `training.fused_backward` each weight's gradient is freed as
    soon as its optimizer has stepped (train/recipe/fused.py), so the plan counts the largest
    single gradient: a lower bound, since the autograd engine may hold the gradients of one
    layer's few weights (a weight and its bias) at once while their hooks run."""
    if not config.training.fused_backward or not trained:
        return "gradients of the trained weights", tensor_bytes(trained)
    largest = max(trained, key=lambda t: tensor_bytes([t]))
    return (f"gradients, one weight's at a time (fused backward: the largest, "
            f"{tuple(largest.shape)})", tensor_bytes([largest]))


def offload_line(config: Config, denoiser: nn.Module) -> tuple[str, int]:
    """`model.offload_blocks`' line: the offloaded blocks' frozen weights leave the device, but
    for the two in flight (the block running and the one prefetched), a negative line. A full
    fine-tune's (train/memory/offload_trained.py) moves their trained weights too, and their
    optimizer state and EMA copy live on the host for the whole run; their gradients are
    made on the device and copied to the host one at a time (the gradients line's)."""
    host = offloaded_host(config, denoiser)
    if not host.trained:
        return (f"{host.count} denoiser blocks offloaded to CPU memory ({gib(host.weights)} of "
                f"weights, less {gib(host.in_flight)} for the two in flight)",
                host.in_flight - host.weights)
    ema = f", {gib(host.ema)} of EMA copy" if config.training.ema else ""
    return (f"{host.count} denoiser blocks offloaded to CPU memory, trained weights included "
            f"({gib(host.weights)} of weights, {gib(host.state)} of their optimizer state"
            f"{ema}; gradients copied there one weight at a time; less {gib(host.in_flight)} "
            "for the two blocks in flight)", host.in_flight - host.total)


@dataclass(frozen=True)
class OffloadedHost:
    """What `model.offload_blocks` keeps in CPU memory instead of the device, in bytes: the
    offloaded blocks' weights and, for a full fine-tune (``trained``), their optimizer state
    and EMA copy; ``in_flight``: the device copies of the two blocks in flight."""
    count: int
    weights: int
    in_flight: int
    trained: bool = False
    state: int = 0
    ema: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.state + self.ema


def offloaded_host(config: Config, denoiser: nn.Module) -> OffloadedHost:
    """The offloaded blocks' host bytes (the memory plan's and the RAM plan's figures), from the
    choice the streamer makes (meta tensors do)."""
    from modules.train.memory.offload import moved_parameters, offload_choice, offload_saving
    trained = config.training.method == TrainingMethod.FINE_TUNE
    names = family_of(config.model.type).repeated_blocks
    choice = offload_choice(denoiser, names, config.model.offload_blocks, trained)
    if choice is None:
        return OffloadedHost(0, 0, 0)
    count, moved, in_flight = offload_saving(denoiser, names, config.model.offload_blocks,
                                             trained)
    if not trained:
        return OffloadedHost(count, moved, in_flight)
    stepped = [p for i in choice.chosen for p in moved_parameters(choice.blocks[i], True)
               if p.requires_grad]
    return OffloadedHost(count, moved, in_flight, True,
                         optimizer_state_bytes(config.training.optimizer, stepped),
                         tensor_bytes(stepped) if config.training.ema else 0)


def describe_tensors(tensors: Sequence[torch.Tensor]) -> str:
    """"bf16, 2,567,463,684 values" (several dtypes: each one's count)."""
    counts: dict[torch.dtype, int] = {}
    for t in tensors:
        counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return ", ".join(f"{DTYPE_LABELS.get(dtype, str(dtype).removeprefix('torch.'))}, "
                     f"{count:,} values" for dtype, count in counts.items())
