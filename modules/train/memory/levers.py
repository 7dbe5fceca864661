"""The memory levers as data (issue 46, issue 58 item 5): each a way to make the same training
fit a smaller card, at a cost, one `Lever` row each in `LEVERS`. The refusal, `--check` and the
GUI read the same rows: a lever's name, what it saves and what it costs in one line each, whether
it is on, off (with the `--set` overrides that turn it on) or not for this run (with why), and
what it needs of the device (`DeviceNeed`), so a lever the card cannot run is named with the
reason instead of offered.

The 8-bit storages of the frozen linear weights are one row per format, in the order the plan
picks them (`picked_storage`): INT8 first, because it runs on every device torchao does and
measured the smaller quality cost on the tiny model (docs/memory.md); FLOAT8 second, because
inductor's GPU code generator (Triton) cannot convert float8 e4m3 values below sm_89, so on an
RTX 30 card or older a compiled block that dequantizes it fails to compile. W8A8 (int8
matmuls, issue 58 item 2) third: it stores the denoiser's layers only, and is a lever for speed
where the card multiplies int8, refused where it does not (`DeviceNeed.refused`).

How "the device multiplies int8" is decided (`INT8_MATMUL_NEED`): on CUDA, by the compute
capability, sm_80 or newer (Ampere: RTX 30, A100, and everything after; an sm_75 card is not
checked, so not offered: docs/memory.md); off CUDA, by running one small `torch._int_mm` on the
device and checking its product (models/int8_matmul.py's `int_mm_problem`: torch 2.13's CPU has
the kernel).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from modules.config.overrides import apply_overrides
from modules.config.problems import Problem
from modules.config.schema import Adapter, Config, TrainingMethod, WeightStorage
from modules.config.validate import fused_backward_problems
from modules.train.recipe.text_cache import text_encoder_stays
from modules.train.recipe.trainable import trained_components


@dataclass(frozen=True)
class DeviceAbility:
    """What the run's device is, for the levers that depend on it: its name for sentences, and
    CUDA's compute capability (None off CUDA: the CPU runs every lever torchao runs)."""
    name: str
    capability: tuple[int, int] | None = None
    int_mm_problem: str = ""  # off CUDA: why torch._int_mm cannot run there ("" when it can)


CPU = DeviceAbility("the CPU")


def device_ability(device: torch.device) -> DeviceAbility:
    """The ability of `device` (the run's, from `general.device`)."""
    if device.type != "cuda":
        from modules.models.int8_matmul import int_mm_problem
        return DeviceAbility(f"the {device.type.upper()}", None, int_mm_problem(device))
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return DeviceAbility(f"{props.name} (sm_{props.major}{props.minor})",
                         (props.major, props.minor))


INT8_INSTEAD = "use model.weight_storage=INT8 (the same int8 weights, 16-bit matmuls)"


@dataclass(frozen=True)
class DeviceNeed:
    """What a lever needs of a CUDA card: a compute capability, and why; `int_mm`: also that a
    device other than CUDA multiplies int8 (`DeviceAbility.int_mm_problem`); `refused`: a run
    with the lever on is refused on a device without it (else only warned: FLOAT8 runs, slower
    or failing to compile)."""
    capability: tuple[int, int]
    why: str
    int_mm: bool = False
    refused: bool = False

    def unmet(self, ability: DeviceAbility) -> str:
        """Why `ability`'s device cannot run the lever, or "" when it can."""
        if ability.capability is None:
            if self.int_mm and ability.int_mm_problem:
                return (f"{ability.name} cannot multiply int8 matrices: "
                        f"{ability.int_mm_problem}; {INT8_INSTEAD}")
            return ""
        if ability.capability >= self.capability:
            return ""
        major, minor = self.capability
        return f"{ability.name} is older than sm_{major}{minor}: {self.why}"


@dataclass(frozen=True)
class LeverState:
    """Where a lever stands for one config: on; off, with the `--set` overrides that turn it
    on (`overrides`); or not for this run, with why (`not_for`)."""
    on: bool = False
    overrides: list[str] | None = None
    not_for: str = ""


ON = LeverState(on=True)


@dataclass(frozen=True)
class Lever:
    """A memory lever. `state(config)`: on, off (with the overrides that turn it on) or not for
    this run (with why); how much it saves is not written here: the plan of the config with the
    overrides says it. `saves` and `costs`: one line each, what it takes off the device and
    what it costs in quality and speed. `needs`: what it needs of a CUDA card (None: any).
    `short`: the one line the GUI shows for it, what it saves and costs."""
    name: str
    state: Callable[[Config], LeverState]
    saves: str
    costs: str
    needs: DeviceNeed | None = None
    short: str = ""

    def state_on(self, config: Config, ability: DeviceAbility) -> LeverState:
        """`state` on this device: a lever the device cannot run is not for this run, with
        why (one that is on already stays on: check_memory warns about it)."""
        state = self.state(config)
        why = self.needs.unmet(ability) if self.needs else ""
        if why and not state.on:
            return LeverState(not_for=f"not on this device: {why}")
        return state

    def overrides(self, config: Config, ability: DeviceAbility) -> list[str] | None:
        """The `--set` overrides that turn it on for this config on this device; None when it
        is on, or not for this run."""
        return self.state_on(config, ability).overrides


def _storage(storage: WeightStorage) -> Callable[[Config], LeverState]:
    """The state of storing the frozen linear weights as `storage`: offered to a LoRA with
    torchao installed whose weights are not stored in 8 bits already."""
    def state(config: Config) -> LeverState:
        current = config.model.weight_storage
        if current == storage:
            return ON
        if current.eight_bit:
            return LeverState(not_for=f"they are stored as {current.value} (one 8-bit storage "
                                      "at a time; both keep a byte a value)")
        if config.training.method != TrainingMethod.LORA:
            return LeverState(not_for="LoRA only (a trained weight is never stored in 8 bits)")
        if storage == WeightStorage.W8A8 and config.training.adapter == Adapter.DORA:
            return LeverState(not_for="not with DoRA (peft's DoRA reads int8 values as the "
                                      "weight)")
        if storage.torchao and importlib.util.find_spec("torchao") is None:  # its plan needs it
            return LeverState(not_for="needs torchao, not installed here (pip install torchao)")
        return LeverState(overrides=[f"model.weight_storage={storage.value}"])
    return state


def _cached_outputs(config: Config) -> LeverState:
    """Cache latents and captions, so the VAE and text encoders stay on the CPU
    (train/recipe/placement.py): offered when either cache is off; a cache that is on and
    not applied (a trained component, captions that change every epoch) says why."""
    d = config.data
    wanted = ([] if d.cache_latents else ["data.cache_latents=true", "data.center_crop=true"]) \
        + ([] if d.cache_text_encoder_outputs else ["data.cache_text_encoder_outputs=true"])
    if wanted:
        return LeverState(overrides=wanted)
    stays = [f"the text encoders stay on the GPU: {why}"
             for why in [text_encoder_stays(config)] if why]
    if "vae" in trained_components(config):
        stays.append("the VAE stays on the GPU: it is trained")
    elif stays:
        stays.append("the VAE leaves it")
    return LeverState(not_for="; ".join(stays)) if stays else ON


def _fused_backward(config: Config) -> LeverState:
    """Step each weight in backward (train/recipe/fused.py): offered to a full fine-tune whose
    other settings it combines with."""
    t = config.training
    if t.fused_backward:
        return ON
    if t.method != TrainingMethod.FINE_TUNE:
        return LeverState(not_for="full fine-tunes only (a LoRA's gradients are small)")
    problems = fused_backward_problems(apply_overrides(config, ["training.fused_backward=true"]))
    if problems:
        return LeverState(not_for="; ".join(p.message or p.detail() for p in problems))
    return LeverState(overrides=["training.fused_backward=true"])


EIGHT_BIT_SAVES = ("the frozen linear layers of the denoiser and text encoders at one byte a "
                   "value (about half of bf16); convolutions, norms and the VAE stay")
DEQUANTIZE_COSTS = ("a dequantization per layer per forward, fused into the compiled block "
                    "(separate kernels in eager layers); a step's backward still holds a "
                    "16-bit copy per layer whose activations it keeps (gradient checkpointing "
                    "bounds that to one block)")
FLOAT8_NEED = DeviceNeed((8, 9), "inductor's GPU code (Triton) cannot convert float8 e4m3 "
                                 "values before sm_89 (RTX 40, L4, H100), so a compiled block "
                                 "that dequantizes float8 fails to compile; INT8 stores the "
                                 "same bytes on any card")
INT8_MATMUL_NEED = DeviceNeed((8, 0), "W8A8 multiplies int8 matrices with torch._int_mm, whose "
                                      "int8 tensor-core kernels (cuBLASLt) Tempera runs from "
                                      f"sm_80 (RTX 30, A100) on; {INT8_INSTEAD}",
                              int_mm=True, refused=True)
W8A8_COSTS = ("quality: each layer's input rounded to 256 levels per token besides the "
              "weight's per row (measured on the tiny model: docs/memory.md); speed: a "
              "quantization of each input per forward, fused into the compiled block, then int8 "
              "x int8 matmuls (the speed-up on a GPU is measured in a later GPU phase, not "
              "claimed); backward multiplies the gradient by the dequantized weight at 16 "
              "bits; the text encoders are not stored; not with DoRA")

# The levers, one row each; the refusal and `--check` offer each that lowers the plan, the
# 8-bit storages in the order the plan picks them (`picked_storage`). Block offload and FSDP
# need the model's block count or the launch, so memory_check.py says their state.
LEVERS: tuple[Lever, ...] = (
    Lever("frozen linear weights stored as int8", _storage(WeightStorage.INT8),
          EIGHT_BIT_SAVES + ", with a scale and a zero point per row",
          "quality: a 2.3 % gap in the trained LoRA's effect on the tiny model at bf16 "
          f"(docs/memory.md); speed: {DEQUANTIZE_COSTS}",
          short="INT8: linear layers at half of bf16; quality -2.3 % (tiny model); a "
                "dequantize per layer, fused when compiled; any card"),
    Lever("frozen linear weights stored as float8", _storage(WeightStorage.FLOAT8),
          EIGHT_BIT_SAVES + ", with a scale per row",
          "quality: a 4.7 % gap in the trained LoRA's effect on the tiny model at bf16 "
          f"(docs/memory.md); speed: {DEQUANTIZE_COSTS}", FLOAT8_NEED,
          short="FLOAT8: the same bytes as INT8; quality -4.7 % (tiny model); the same "
                "dequantize; RTX 40 / sm_89 or newer"),
    Lever("the denoiser's linear layers as int8 with int8 matmuls (W8A8)",
          _storage(WeightStorage.W8A8),
          "the frozen linear layers of the denoiser at one byte a value (about half of bf16), "
          "with a scale per row; the text encoders, convolutions, norms and the VAE stay",
          W8A8_COSTS, INT8_MATMUL_NEED,
          short="W8A8: the denoiser's linear layers as INT8 stores them, multiplied in int8 "
                "(speed on a GPU not yet measured); activations rounded per token; sm_80 "
                "(RTX 30) or newer"),
    Lever("text encoders and VAE off the GPU (their outputs cached)", _cached_outputs,
          "the text encoders' and the VAE's weights while training",
          "no random crop; the VAE comes back to the GPU for each sampling pass"),
    Lever("the fused backward pass (full fine-tunes)", _fused_backward,
          "the gradients, but one weight's at a time",
          "no gradient accumulation; gradients clipped per weight; one optimizer per weight"),
)
STORAGE_LEVERS = {WeightStorage.INT8: LEVERS[0], WeightStorage.FLOAT8: LEVERS[1],
                  WeightStorage.W8A8: LEVERS[2]}


def picked_storage(ability: DeviceAbility) -> WeightStorage:
    """The 8-bit storage the plan picks on this device: the first of `STORAGE_LEVERS` it can
    run (what the small-card presets that need 8 bits use)."""
    return next(storage for storage, lever in STORAGE_LEVERS.items()
                if not (lever.needs and lever.needs.unmet(ability)))


def lever_override(lever_overrides: list[str]) -> str:
    """A lever's overrides as one `--set` argument list ("a=1 --set b=2")."""
    return " --set ".join(lever_overrides)


def storage_summaries(ability: DeviceAbility) -> list[str]:
    """One line per 8-bit storage for the GUI's *Frozen weights storage* field: what it saves
    and costs, or why this machine cannot run it (greyed)."""
    lines = []
    for storage, lever in STORAGE_LEVERS.items():
        why = lever.needs.unmet(ability) if lever.needs else ""
        lines.append(f"{storage.value}: not on this machine: {why}" if why else lever.short)
    return lines


def not_on_device(config: Config, ability: DeviceAbility) -> list[tuple[str, str]]:
    """(lever, why) for each lever this run could turn on but this device cannot run."""
    found = []
    for lever in LEVERS:
        state = lever.state(config)
        why = lever.needs.unmet(ability) if lever.needs else ""
        if why and state.overrides:
            found.append((lever_override(state.overrides), why))
    return found


def device_warnings(config: Config, ability: DeviceAbility) -> list[str]:
    """A warning for each lever that is on although this device cannot run it (a FLOAT8
    preset on an RTX 30 card, say), of those the device is not refused for."""
    found = []
    for lever in LEVERS:
        why = lever.needs.unmet(ability) if lever.needs else ""
        if why and lever.state(config).on and not (lever.needs and lever.needs.refused):
            found.append(f"{lever.name} is on, and {why}")
    return found


def device_refusals(config: Config, ability: DeviceAbility) -> list[Problem]:
    """A problem for each lever that is on and this device cannot run at all (W8A8 where
    there are no int8 kernels): the run is refused before anything is loaded."""
    found = []
    for lever in LEVERS:
        why = lever.needs.unmet(ability) if lever.needs and lever.needs.refused else ""
        if why and lever.state(config).on:
            found.append(Problem("model.weight_storage", f"a storage {ability.name} runs",
                                 config.model.weight_storage.value,
                                 f"{lever.name} is on, and {why}"))
    return found
