"""The memory plan (train/memory/memory_plan.py) against the GPU: refuse a run whose lower bound is
more than the card holds, before anything is loaded onto it (a ConfigError from the check
phase, like every other problem of the user's input), warn when it leaves too little room
for activations, and name the changes that would make it fit, with what each saves.

The decision is taken on the card's total memory, not on what is free right now: memory that
other processes hold may be released before the run needs it (and this process's own cached
blocks, say an earlier run in the GUI, count as used to the driver), so free memory only
makes a warning.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from modules.config.overrides import apply_overrides
from modules.config.optimizers import OPTIMIZERS
from modules.config.problems import ConfigError, Problem
from modules.config.schema import (CompileScope, Config, DistributedStrategy, DType,
                                   TrainingMethod)
from modules.config.validate import fsdp_problems, fused_backward_problems
from modules.model_types import MODEL_TYPES
from modules.models.bundle import ModelBundle
from modules.models.families import family_of
from modules.train.memory.offload import denoiser_blocks
from modules.train.memory.ram_plan import (RamPlan, loading_lines, machine_ram, ram_plan_from,
                                           ram_refusal)
from modules.train.memory.memory_plan import (WARN_FRACTION, MemoryPlan, gib, plan_from,
                                              plan_memory, weightless_bundle,
                                              weightless_trainable)
from modules.train.memory.levers import (CPU, LEVERS, STORAGE_LEVERS, DeviceAbility, LeverState,
                                         device_ability, device_refusals, device_warnings,
                                         lever_override,
                                         not_on_device, picked_storage)
from modules.train.recipe.trainable import prepare_trainable, trained_components
from modules.util.errors import describe

MAX_OPTIMIZER_FIXES = 3
# fixes that leave the weights as they are (the plan is recomputed on the same weightless model)
SAME_WEIGHTS = {"training.optimizer", "training.ema", "training.fused_backward",
                "model.offload_blocks"}


@dataclass(frozen=True)
class CardMemory:
    name: str
    total_bytes: int
    free_bytes: int  # free to this process: the driver's free plus this process's cached blocks


@dataclass
class MemoryCheck:
    """The plan (None when it could not be computed: a warning says why), the card it was
    compared with (None off CUDA) and the warnings it gave; the RAM plan (ram_plan.py) and the
    machine's RAM it was checked against."""
    plan: MemoryPlan | None
    card: CardMemory | None
    warnings: list[str] = field(default_factory=list)
    ram: RamPlan | None = None
    ram_total: int = 0

    def record(self) -> dict:
        """run.json's `memory_plan`: the plan in bytes and the card it was checked against."""
        card = ({"name": self.card.name, "total_bytes": self.card.total_bytes}
                if self.card else None)
        return {**(self.plan.record() if self.plan else {"total_bytes": None}), "card": card,
                "warnings": list(self.warnings),
                "ram": ({**self.ram.record(), "machine_bytes": self.ram_total}
                        if self.ram else None)}

    def summary(self) -> str:
        """One line for the run's log on a card (the GUI's Run tab, the CLI): what the plan
        takes of it. Empty off CUDA or without a plan."""
        if not (self.plan and self.card):
            return ""
        return (f"memory plan: at least {gib(self.plan.total)} of {self.card.name}'s "
                f"{gib(self.card.total_bytes)} ({self.plan.total / self.card.total_bytes:.0%}) "
                "before activations; run.json's memory_plan itemises it")

    def describe(self) -> list[str]:
        """What `--check` prints: the card (or that there is none to compare with), the
        plan's lines and the warnings."""
        head = (f"memory plan for {self.card.name} ({gib(self.card.total_bytes)}):"
                if self.card else "memory plan (no CUDA device here to compare with):")
        lines = self.plan.describe() if self.plan else ["not computed"]
        ram = ([f"RAM plan (this machine has {gib(self.ram_total)}):",
                *(f"  {line}" for line in self.ram.describe())] if self.ram else [])
        return [head, *(f"  {line}" for line in lines), *ram,
                *(f"warning: {w}" for w in self.warnings)]


def card_memory(device: torch.device) -> CardMemory | None:
    """The CUDA card the run will use, or None on any other device (the check is then only
    the plan: a CPU's or MPS' memory is shared with everything else)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, _ = torch.cuda.mem_get_info(index)
    own_cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
    props = torch.cuda.get_device_properties(index)
    return CardMemory(props.name, int(props.total_memory), int(free + own_cached))


def check_memory(config: Config, model_path: Path, device: torch.device,
                 distributed: bool = False, ram: int | None = None) -> MemoryCheck:
    """The run's memory plan, checked against the card: raises ConfigError when the lower
    bound is more than the card's memory; returns the plan with warnings otherwise. A plan
    that cannot be computed (a model whose config files this reading does not know) stops
    nothing: the loader reports a model it cannot load, and the run says the check was not
    made. A lever that is on although this device cannot run it (FLOAT8 on an RTX 30 card)
    is a warning, or refused when it cannot run at all (W8A8 without int8 kernels). The RAM plan is checked against `ram` (default: this machine's) the same
    way, on any device."""
    card, ability = card_memory(device), device_ability(device)
    refused = device_refusals(config, ability)
    if refused:  # W8A8 on a device without int8 kernels: nothing to plan
        raise ConfigError(refused)
    try:
        bundle = weightless_bundle(config, model_path)  # one weightless model for both plans
        loading = loading_lines(bundle)
        params = prepare_trainable(bundle, config)
        plan = plan_from(config, bundle, params, distributed)
        ram_plan = ram_plan_from(config, loading, bundle, params, device)
    except Exception as err:  # noqa: BLE001 - the check is advice; loading reports real errors
        return MemoryCheck(None, card, [f"the memory plan could not be computed "
                                        f"({describe(err)}): no up-front memory check"])
    ram = ram or machine_ram()
    if ram_plan.peak.total > ram:
        raise ConfigError([ram_refusal(config, model_path, device, ram_plan, ram)])
    check = MemoryCheck(plan, card, device_warnings(config, ability), ram_plan, ram)
    if card is None:
        return check
    if plan.total > card.total_bytes:
        raise ConfigError([refusal(config, model_path, plan, card, distributed, ability)])
    if plan.total > WARN_FRACTION * card.total_bytes:
        check.warnings.append(
            f"the weights, gradients and optimizer state alone need {gib(plan.total)} of "
            f"{card.name}'s {gib(card.total_bytes)} ({plan.total / card.total_bytes:.0%}): "
            "activations will likely not fit. "
            + fixes_sentence(config, model_path, plan, distributed, ability))
    elif plan.total > card.free_bytes:
        check.warnings.append(
            f"the run needs at least {gib(plan.total)}, and only {gib(card.free_bytes)} of "
            f"{card.name}'s {gib(card.total_bytes)} is free now: other processes hold the rest")
    return check


def refusal(config: Config, model_path: Path, plan: MemoryPlan, card: CardMemory,
            distributed: bool, ability: DeviceAbility) -> Problem:
    """The problem a run that cannot fit reports: where, what it needs, on what, and how to
    make it fit."""
    t = config.training
    path = "training.method" if t.method == TrainingMethod.FINE_TUNE else "training.optimizer"
    items = "; ".join(f"{what} {gib(size)}" for what, size in plan.lines)
    return Problem(path, f"a run whose weights, gradients and optimizer state fit in "
                         f"{card.name}'s {gib(card.total_bytes)}",
                   f"{t.method.value} with {OPTIMIZERS[t.optimizer].label}, which needs at "
                   f"least {gib(plan.total)} before activations",
                   f"it needs {items}. "
                   + fixes_sentence(config, model_path, plan, distributed, ability))


def fixes_sentence(config: Config, model_path: Path, plan: MemoryPlan, distributed: bool,
                   ability: DeviceAbility) -> str:
    """The fixes that lower the plan, each with what it saves (a lever's also with what it
    costs), and the levers this device cannot run, each with why."""
    found = memory_fixes(config, model_path, plan, distributed, ability)
    offload = next((o.split(" --set ")[-1] for o, _ in found if "model.offload_blocks=" in o),
                   None)  # alone or with 8-bit storage: its override names the block count
    costs = lever_costs(config, ability, offload)
    cannot = "".join(f" Not offered: --set {o}, as {why}." for o, why in
                     not_on_device(config, ability))
    if not found:
        return ("No setting of this run saves memory before activations: use a larger GPU."
                + cannot)
    return "What saves memory: " + "; ".join(
        f"--set {o} saves {gib(saved)} (then {gib(plan.total - saved)}"
        + (f"; costs: {costs[o]})" if o in costs else ")")
        for o, saved in found) + "." + cannot


def fix_candidates(config: Config, ability: DeviceAbility | None = None) -> list[str]:
    """`--set` overrides that may lower this config's plan: LoRA instead of a full fine-tune,
    a leaner optimizer, not training a text encoder, no EMA, 16-bit weights, and each lever of
    `LEVERS` that applies and this device runs (several overrides of one lever joined by
    " --set "); `ability`: the device's (by default the CPU's, which runs every lever)."""
    t, spec = config.training, MODEL_TYPES[config.model.type]
    ability = ability or CPU
    found = []
    if t.method == TrainingMethod.FINE_TUNE:
        found.append("training.method=LORA")
    found += [f"training.optimizer={o.value}" for o in OPTIMIZERS if o != t.optimizer]
    if t.method != TrainingMethod.TEXTUAL_INVERSION:  # it trains the text encoders' rows
        found += [f"components.{name}.train=false" for name in trained_components(config)
                  if name in spec.text_encoders]
    if t.ema:
        found.append("training.ema=false")
    if config.model.weight_dtype == DType.FLOAT32:
        found.append("model.weight_dtype=BFLOAT16")
    if t.method == TrainingMethod.FINE_TUNE and config.model.train_dtype == DType.FLOAT32:
        found.append("model.train_dtype=BFLOAT16")
    for lever in LEVERS:
        overrides = lever.overrides(config, ability)
        if overrides:
            found.append(lever_override(overrides))
    return found


OFFLOAD_COSTS = ("a copy of each offloaded block per step, overlapped with compute on a GPU; "
                 "a full fine-tune also copies each of their gradients to CPU memory and "
                 "steps their optimizer there (CPU time every step); REGIONAL compile only")


def offload_not_for(config: Config) -> str:
    """Why block offload cannot serve this run (validate's `_check_block_offload`), or ""."""
    method = config.training.method
    if method == TrainingMethod.FINE_TUNE and not config.training.fused_backward:
        return ("a full fine-tune offloads with training.fused_backward=true only (its "
                "weights step on the host inside backward)")
    if method not in (TrainingMethod.LORA, TrainingMethod.FINE_TUNE):
        return "LoRA and fused full fine-tunes only"
    if config.compile.denoiser and config.compile.scope == CompileScope.FULL:
        return "needs REGIONAL compile of the denoiser (compile.scope is FULL)"
    return ""


FUSED_ON = "training.fused_backward=true"


def offload_overrides(config: Config, blocks: int) -> list[str] | None:
    """The overrides that offload all the denoiser's ``blocks`` repeated blocks (the most it
    saves): the count alone where this run can offload, with the fused backward pass turned on
    for a full fine-tune that combines with it; None where offload cannot serve."""
    if not blocks:
        return None
    count = f"model.offload_blocks={blocks}"
    if not offload_not_for(config):
        return [count]
    if config.training.method == TrainingMethod.FINE_TUNE and not config.training.fused_backward:
        fused = apply_overrides(config, [FUSED_ON])
        if not offload_not_for(fused) and not fused_backward_problems(fused):
            return [FUSED_ON, count]
    return None


def offload_candidates(config: Config, blocks: int) -> list[str]:
    """Block offload of every block, for a run that does not offload yet and can (a full
    fine-tune with the fused pass, turned on with it where it is off)."""
    overrides = None if config.model.offload_blocks else offload_overrides(config, blocks)
    return [lever_override(overrides)] if overrides else []


BOTH_LEVERS = "8-bit storage and block offload together"


def both_candidates(config: Config, blocks: int, ability: DeviceAbility | None) -> list[str]:
    """The 8-bit storage the plan picks on this device and block offload of every block, in
    one override list, for a LoRA that has neither on yet and can take both (a model whose
    weights fit with neither lever alone may fit with the two)."""
    ability = ability or CPU
    storage = STORAGE_LEVERS[picked_storage(ability)].overrides(config, ability)
    offload = offload_candidates(config, blocks)
    return [lever_override(storage + offload)] if storage and offload else []


def lever_costs(config: Config, ability: DeviceAbility, blocks_override: str | None
                ) -> dict[str, str]:
    """What each lever's override costs, keyed by the override (a `--set` argument list):
    `LEVERS`' rows, block offload's (``blocks_override``: its override for this model, when
    offered) and the two together."""
    costs = {lever_override(overrides): lever.costs for lever in LEVERS
             for overrides in [lever.overrides(config, ability)] if overrides}
    if blocks_override:
        costs[blocks_override] = OFFLOAD_COSTS
        picked = STORAGE_LEVERS[picked_storage(ability)]
        storage = picked.overrides(config, ability)
        if storage:
            costs[lever_override([*storage, blocks_override])] = (
                f"{picked.costs}; and block offload's: {OFFLOAD_COSTS}")
        if FUSED_ON in costs:  # a full fine-tune offloads with the fused pass
            costs[lever_override([FUSED_ON, blocks_override])] = (
                f"{costs[FUSED_ON]}; and block offload's: {OFFLOAD_COSTS}")
    return costs


FSDP_OVERRIDE = "training.distributed_strategy=FSDP"
FSDP_LEVER = "weights, gradients and optimizer state sharded over processes (FSDP)"
FSDP_COSTS = ("each block's weights gathered from every process for its forward and backward "
              "and its gradients reduce-scattered (network traffic every step); full "
              "fine-tunes only, without EMA or FP16 (docs/cloud.md, Multi-GPU)")


def fsdp_processes(distributed: bool) -> int:
    """How many processes FSDP would shard over here: this launch's when several run
    (WORLD_SIZE, the launchers' contract), else one per GPU this process sees (0 or 1: none
    to shard over)."""
    if distributed:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def fsdp_candidate(config: Config) -> str | None:
    """FSDP's override for a full fine-tune that does not shard yet and whose other settings
    it combines with (validate's FSDP refusals); None where it does not apply."""
    if (config.training.method != TrainingMethod.FINE_TUNE
            or config.training.distributed_strategy == DistributedStrategy.FSDP):
        return None
    if fsdp_problems(apply_overrides(config, [FSDP_OVERRIDE])):
        return None
    return FSDP_OVERRIDE


def fsdp_fix(processes: int, distributed: bool) -> str:
    """The FSDP fix as the refusal and `--check` name it: the override and the launch."""
    if distributed:
        return f"{FSDP_OVERRIDE} (sharded over this launch's {processes} processes)"
    return (f"{FSDP_OVERRIDE} (launched as {processes} processes, one per visible GPU: "
            f"accelerate launch --num_processes {processes})")


def fsdp_saving(config: Config, plan: MemoryPlan,
                trainable: tuple[ModelBundle, dict[str, list[nn.Parameter]]],
                processes: int) -> int:
    """What each process saves when FSDP shards `config`'s run over `processes` processes
    (the plan divides what is sharded by their number); `trainable`: weightless_trainable's."""
    changed = apply_overrides(config, [FSDP_OVERRIDE])
    bundle, params = trainable
    return plan.total - plan_from(changed, bundle, params, True, processes).total


def memory_fixes(config: Config, model_path: Path, plan: MemoryPlan, distributed: bool = False,
                 ability: DeviceAbility | None = None) -> list[tuple[str, int]]:
    """(override, bytes it saves) for each candidate that lowers the plan on this device
    (`fix_candidates`), largest first; of the optimizers only the best few. An optimizer that
    needs a package not installed here says so."""
    found: list[tuple[str, int]] = []
    seen_states = {OPTIMIZERS[config.training.optimizer].state}
    trainable = weightless_trainable(config, model_path)  # reused where the weights stay
    names = family_of(config.model.type).repeated_blocks
    blocks = len(denoiser_blocks(trainable[0].denoiser, names))
    for override in (fix_candidates(config, ability) + offload_candidates(config, blocks)
                     + both_candidates(config, blocks, ability)):
        changed = apply_overrides(config, override.split(" --set "))
        state = OPTIMIZERS[changed.training.optimizer].state
        if override.startswith("training.optimizer="):
            if state in seen_states:  # the same state as one named already (Adafactor's two)
                continue
            seen_states.add(state)
        if override.split("=")[0] in SAME_WEIGHTS:
            saved = plan.total - plan_from(changed, *trainable, distributed).total
        else:
            saved = plan.total - plan_memory(changed, model_path, distributed).total
        if saved > 0:
            found.append((describe_override(override), saved))
    processes = fsdp_processes(distributed)
    if fsdp_candidate(config) and processes > 1:  # one card: nothing to shard over here
        saved = fsdp_saving(config, plan, trainable, processes)
        if saved > 0:
            found.append((fsdp_fix(processes, distributed), saved))
    found.sort(key=lambda item: -item[1])
    optimizers = [f for f in found if f[0].startswith("training.optimizer=")]
    dropped = {f[0] for f in optimizers[MAX_OPTIMIZER_FIXES:]}
    return [f for f in found if f[0] not in dropped]


def run_ability(config: Config) -> DeviceAbility:
    """The ability of the device `general.device` picks (the run's)."""
    from modules.train.recipe.builders import pick_device
    return device_ability(pick_device(config.general.device))


def levers_report(config: Config, model_path: Path, plan: MemoryPlan, distributed: bool = False,
                  ability: DeviceAbility | None = None) -> list[str]:
    """What `--check` prints after the plan: each lever of `LEVERS`, on already, not for this
    run (or this device), or with what it saves and what it costs; the 8-bit storage the plan
    picks on this device is marked."""
    ability = ability or run_ability(config)
    saved = dict(memory_fixes(config, model_path, plan, distributed, ability))
    lines = ["memory levers:"]
    for lever in LEVERS:
        state = lever_line(lever.state_on(config, ability), lever.costs, saved, plan)
        lines.append(f"  {lever.name}: {state}")
    # block offload's override names the denoiser's block count, known from the model only
    offload = next((key for key in saved if key.startswith(
        ("model.offload_blocks=", f"{FUSED_ON} --set model.offload_blocks="))), None)
    why = "" if offload else offload_not_for(config)
    state = lever_line(LeverState(on=bool(config.model.offload_blocks), not_for=why,
                                  overrides=[offload] if offload else None),
                       OFFLOAD_COSTS, saved, plan)
    lines.append(f"  denoiser blocks streamed from CPU memory (block offload): {state}")
    both = next((key for key in saved if "--set model.offload_blocks=" in key
                 and not key.startswith(FUSED_ON)), None)
    if both:
        lines.append(f"  {BOTH_LEVERS}: " + lever_line(
            LeverState(overrides=both.split(" --set ")),
            lever_costs(config, ability, both.split(" --set ")[-1])[both], saved, plan))
    lines.append(f"  {FSDP_LEVER}: {fsdp_state(config, model_path, plan, saved, distributed)}")
    picked = picked_storage(ability)
    lines.append(f"the 8-bit storage the plan picks on {ability.name}: {picked.value} "
                 f"({STORAGE_LEVERS[picked].name})")
    return lines


def lever_line(state: LeverState, costs: str, saved: dict[str, int], plan: MemoryPlan) -> str:
    """One lever's state as `--check` prints it: "on", "not for this run: why", or "off" with
    what turning it on saves and costs (or that it saves nothing here)."""
    if state.on:
        return "on"
    if state.not_for:
        return f"not for this run: {state.not_for}"
    key = lever_override(state.overrides or [])
    if key not in saved:
        return "off; turning it on saves nothing for this run"
    return (f"off; --set {key} saves {gib(saved[key])} (then {gib(plan.total - saved[key])}); "
            f"costs: {costs}")


def fsdp_state(config: Config, model_path: Path, plan: MemoryPlan, saved: dict[str, int],
               distributed: bool) -> str:
    """`--check`'s FSDP line: what sharding saves on this machine's processes or GPUs; with
    one GPU (or none) visible, what it would save over two, said as needing more cards."""
    if config.training.distributed_strategy == DistributedStrategy.FSDP:
        return "on"
    if config.training.method != TrainingMethod.FINE_TUNE:
        return "not for this run: full fine-tunes only (DDP fits adapters and embeddings)"
    if not fsdp_candidate(config):
        return ("not for this run: "
                + "; ".join(p.message or p.detail()
                            for p in fsdp_problems(apply_overrides(config, [FSDP_OVERRIDE]))))
    processes = fsdp_processes(distributed)
    if processes > 1:
        key = fsdp_fix(processes, distributed)
        if key not in saved:
            return "off; turning it on saves nothing for this run"
        return (f"off; --set {key} saves {gib(saved[key])} per process (then "
                f"{gib(plan.total - saved[key])}); costs: {FSDP_COSTS}")
    two = fsdp_saving(config, plan, weightless_trainable(config, model_path), 2)
    seen = "one GPU is" if processes == 1 else "no GPU is"
    return (f"off; needs several GPUs, and {seen} visible here: sharded over 2 processes on 2 "
            f"GPUs ({FSDP_OVERRIDE}, accelerate launch --num_processes 2) each would need "
            f"{gib(two)} less (then {gib(plan.total - two)})")


def describe_override(override: str) -> str:
    """The override, with what it needs when that is a package this machine lacks."""
    key, _, value = override.partition("=")
    if key != "training.optimizer":
        return override
    row = next(row for o, row in OPTIMIZERS.items() if o.value == value)
    missing = row.package and importlib.util.find_spec(row.module.split(".")[0]) is None
    return override + (f" ({row.label}, needs pip install {row.package})" if missing
                       else f" ({row.label})")
