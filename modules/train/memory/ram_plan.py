"""The system RAM plan (issue 58 item 4): the CPU memory a run needs at its three peaks, so a
run the machine cannot hold is refused before anything is loaded, with the change that makes it
fit, as the GPU plan (memory_plan.py) does for the card.

The phases follow what the run does (train/recipe/recipe.py `_build`):
- loading: every component is read into CPU memory at the dtype it is loaded at (diffusers'
  and transformers' `from_pretrained` read one component's safetensors at a time, and the
  components all stay on the CPU until the run moves them). A run that loads its text encoder
  first (train/setup/text_first.py: captions cached, a family with `text_first`) has two
  loading phases instead, the text encoder alone, then the rest without it; the encoder is
  counted in no later phase (released); a file stored at a wider dtype
  than the component is loaded at holds its tensors once more while they are cast (not
  counted: the plan reads configs, not files). Measured on the tiny SD 1.5 (2.63 MB of
  weights in float32, its files in float32): the process's resident memory grew by 2.95 MB
  over a second load_bundle (tests/train/test_ram_plan.py checks it stays above the plan);
- caching: the components after 8-bit storage and adapters (`prepare_trainable`), on the CPU
  but for the one encoder that borrows the device at a time (the largest counted as away);
- training: what stays on the CPU: the components whose outputs are cached (placement.py), and
  the blocks block offload streams (pinned memory on CUDA); on a CPU device the whole run.
With its text encoder outputs cached, every phase from the one that caches the captions on
holds the caption rows the cache keeps in memory: the most recent, at most
`RESIDENT_ROW_BYTES` (train/recipe/text_cache.py); every other row stays on disk and is read
for each batch, so a dataset's captions never fill the RAM (2,000 Klein 9B captions would be
25 GB). Counted at the bound, which a dataset of a large encoder fills (5 Klein 9B captions).
Not counted: the cached latents (on disk, read per batch), the data loader's worker processes,
Python and the libraries themselves (a few GiB with torch and CUDA), the compiler's memory. A
lower bound, like the GPU plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from modules.config.overrides import apply_overrides
from modules.config.problems import Problem
from modules.config.schema import Config, DType, TrainingMethod
from modules.models.bundle import ModelBundle
from modules.models.families import family_of
from modules.train.memory.memory_plan import (describe_tensors, gib, offloaded_host, plan_from,
                                              tensor_bytes, weightless_bundle)
from modules.train.recipe.placement import components_off_device

NOT_COUNTED = ("a lower bound: cached latents (on disk), data loader workers, "
               "Python, torch and CUDA themselves and the compiler are not counted")


@dataclass(frozen=True)
class RamPhase:
    """One phase's CPU memory, as (what, bytes) lines."""
    name: str
    lines: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(size for _, size in self.lines)


@dataclass(frozen=True)
class RamPlan:
    """The CPU memory of each phase of a run; its peak is the largest phase. `text_order`:
    how the text encoder loads (first and alone, or with the rest and why)."""
    phases: tuple[RamPhase, ...]
    text_order: str = ""

    @property
    def peak(self) -> RamPhase:
        return max(self.phases, key=lambda phase: phase.total)

    def describe(self) -> list[str]:
        """What `--check` prints: each phase's total and lines, then the peak."""
        out = []
        for phase in self.phases:
            out.append(f"{phase.name}: {gib(phase.total)}")
            out += [f"  {what}: {gib(size)}" for what, size in phase.lines]
        return out + ([self.text_order] if self.text_order else []) + [
            f"peak: {gib(self.peak.total)} while {self.peak.name} ({NOT_COUNTED})"]

    def record(self) -> dict:
        """run.json's `ram_plan`, in bytes."""
        return {"peak_bytes": self.peak.total, "peak_phase": self.peak.name,
                "phases": {p.name: {"total_bytes": p.total,
                                    "lines": [{"what": w, "bytes": b} for w, b in p.lines]}
                           for p in self.phases},
                "text_encoder_order": self.text_order, "counts": NOT_COUNTED}


def machine_ram() -> int:
    """This machine's physical memory, in bytes (psutil, which accelerate already needs)."""
    import psutil
    return int(psutil.virtual_memory().total)


def _weights(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def plan_ram(config: Config, model_path: Path, device: torch.device) -> RamPlan:
    """The RAM plan of `config` on the model at `model_path` for a run on `device`, computed on
    weightless copies (nothing is loaded)."""
    from modules.train.recipe.trainable import prepare_trainable
    bundle = weightless_bundle(config, model_path)
    loading = loading_lines(bundle)
    return ram_plan_from(config, loading, bundle, prepare_trainable(bundle, config), device)


def loading_lines(bundle: ModelBundle) -> list[tuple[str, int]]:
    """The loading phase's lines: each component as loaded (a bundle not made trainable)."""
    return [(f"{name} weights as loaded ({describe_tensors(_weights(m))})",
             tensor_bytes(_weights(m))) for name, m in bundle.components().items()]


def ram_plan_from(config: Config, loading: list[tuple[str, int]], bundle: ModelBundle,
                  params: dict[str, list[nn.Parameter]], device: torch.device) -> RamPlan:
    """The RAM plan from the loading phase's lines and the same bundle made trainable
    (`params`: its trained parameters), so the check builds the weightless model once for
    both plans."""
    loaded = dict(zip(bundle.components(), (size for _, size in loading)))
    held = {name: tensor_bytes(_weights(m)) for name, m in bundle.components().items()}
    off = components_off_device(config)
    first, order = text_order(config, bundle)
    loading_phases: tuple[RamPhase, ...] = (RamPhase("loading", tuple(loading)),)
    if first:  # the text encoders are gone before the rest loads, and for the whole run
        lines = dict(zip(bundle.components(), loading))
        loading_phases = (
            RamPhase("loading the text encoder", tuple(lines[n] for n in first)),
            RamPhase("loading", tuple(line for n, line in lines.items() if n not in first)))
        held = {name: size for name, size in held.items() if name not in first}
        off = {name: why for name, why in off.items() if name not in first}
    # one cached component on the device at a time: the largest is counted as away
    away = max(off, key=lambda name: held[name]) if off and device.type == "cuda" else None
    adapters = config.training.method == TrainingMethod.LORA  # a fine-tune trains the weights
    caching = [(f"{name} weights" + (" and adapters" if adapters and params.get(name) else "")
                + (", 8-bit storage applied" if loaded[name] > size else "")
                + (f" (on the device while its outputs are cached: {gib(size)} there)"
                   if name == away else ""), 0 if name == away else size)
               for name, size in held.items()]
    if device.type != "cuda":  # the device is this memory: the whole run lives in it
        gpu = plan_from(config, bundle, params)
        training = [("the run's weights, gradients and optimizer state (the device is the "
                     "CPU: the memory plan's total)", gpu.total)]
        training += [(f"{name} weights (kept off the device)", held[name]) for name in off]
    else:
        training = [(f"{name} weights (on the CPU: {why})", held[name])
                    for name, (why, _) in off.items()]
    if config.model.offload_blocks:
        host = offloaded_host(config, bundle.denoiser)
        training.append((f"{host.count} offloaded denoiser blocks' weights"
                         + (" (pinned)" if device.type == "cuda" else "")
                         + (" and their optimizer state" if host.trained else "")
                         + (" and EMA copy" if host.ema else ""), host.total))
    phases = (*loading_phases, RamPhase("caching", tuple(caching)),
              RamPhase("training", tuple(training)))
    return RamPlan(with_caption_rows(config, phases, bool(first)), order)


def with_caption_rows(config: Config, phases: tuple[RamPhase, ...],
                      text_first: bool) -> tuple[RamPhase, ...]:
    """`phases` with the caption rows a text cache holds in memory (`RESIDENT_ROW_BYTES`, the
    others on disk) added to each phase the cache lives through: every phase when the text
    encoder loads first (it caches them before the rest loads), the caching and training
    phases otherwise."""
    from modules.train.recipe.text_cache import RESIDENT_ROW_BYTES
    if not config.data.cache_text_encoder_outputs:
        return phases
    line = (f"caption rows in memory (the most recent, at most {gib(RESIDENT_ROW_BYTES)}; "
            "every other cached caption is read from disk for each batch)", RESIDENT_ROW_BYTES)
    return tuple(RamPhase(p.name, (*p.lines, line))
                 if text_first or p.name in ("caching", "training") else p for p in phases)


def text_order(config: Config, bundle: ModelBundle) -> tuple[tuple[str, ...], str]:
    """(the text encoders loaded first and released before the rest loads, or none; what the
    plan says of it): the order train/setup/text_first.py follows (`text_encoder_first`)."""
    from modules.train.recipe.text_cache import text_encoder_first
    encoders = tuple(name for name in bundle.components() if name in bundle.text_encoders)
    why_not = text_encoder_first(config)
    if not why_not:
        return encoders, ("text encoder: loaded first and alone, every caption cached, then "
                          "released before the rest loads (never in RAM with the denoiser)")
    if family_of(config.model.type).text_first is None:
        return (), ""  # the family loads every component at once: nothing to choose
    return (), f"text encoder: loaded with the rest ({why_not})"


def ram_fix_candidates(config: Config) -> list[str]:
    """Overrides that may lower the RAM peak: 16-bit frozen weights (the loading peak), 8-bit
    storage of a LoRA's frozen weights (caching and training), fewer offloaded blocks
    (training)."""
    found = []
    if config.model.weight_dtype == DType.FLOAT32:
        found.append("model.weight_dtype=BFLOAT16")
    if (config.training.method == TrainingMethod.LORA
            and not config.model.weight_storage.eight_bit and not config.model.offload_blocks):
        found.append("model.weight_storage=INT8")
    if config.model.offload_blocks:
        found.append("model.offload_blocks=0")
    return found


def ram_refusal(config: Config, model_path: Path, device: torch.device, plan: RamPlan,
                ram: int) -> Problem:
    """The problem a run whose RAM peak is more than the machine's: the peak, its phase, and
    each change with the peak it leaves (those that fit first)."""
    peak = plan.peak
    fixes = []
    for override in ram_fix_candidates(config):
        changed = plan_ram(apply_overrides(config, [override]), model_path, device).peak
        if changed.total < peak.total:
            fits = "fits" if changed.total <= ram else "still too much"
            fixes.append((changed.total > ram, f"--set {override} makes the peak "
                                               f"{gib(changed.total)} ({fits})"))
    said = "; ".join(text for _, text in sorted(fixes, key=lambda f: f[0]))
    items = "; ".join(f"{what} {gib(size)}" for what, size in peak.lines)
    return Problem("model.path", f"a run whose CPU memory peak fits this machine's "
                                 f"{gib(ram)} of RAM",
                   f"a peak of at least {gib(peak.total)} while {peak.name}",
                   f"while {peak.name} it holds {items}. "
                   + (f"What lowers it: {said}." if said else
                      "No setting of this run lowers it: use a machine with more RAM."))
