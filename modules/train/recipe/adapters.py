"""Adding the configured adapter (LoRA, LoCon, LoHa, LoKr, DoRA) to a component with peft.

The table in modules/config/adapters.py says what each method is; this module turns a row and
the training options into a peft config, injects it with the component's `add_adapter` (so the
component keeps its class and state-dict keys) and makes peft's LoHa/LoKr layers compile
without graph breaks.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from modules.config.adapters import (
    ADAPTERS,
    CONV_TARGETS,
    LOCON_LINEAR_TARGETS,
    TEXT_ENCODER_LOCON_TARGETS,
    TEXT_ENCODER_TARGETS,
)
from modules.config.schema import Adapter, Config, TrainingMethod
from modules.data.seeds import derive_seed

if TYPE_CHECKING:
    from diffusers import ModelMixin
    from transformers import PreTrainedModel


def adapter_of(config: Config) -> Adapter:
    return config.training.adapter


def target_modules(config: Config, denoiser: bool) -> tuple[list[str], list[str]]:
    """(linear-rank targets, conv-rank targets) of one component, as peft module suffixes."""
    row = ADAPTERS[adapter_of(config)]
    if not denoiser:
        extra = TEXT_ENCODER_LOCON_TARGETS if row.locon_layers else ()
        return [*TEXT_ENCODER_TARGETS, *extra], []
    linear = list(config.training.lora_target_modules)
    if row.locon_layers:
        linear += [t for t in LOCON_LINEAR_TARGETS if t not in linear]
    convs = list(CONV_TARGETS) if row.convolutions and config.training.conv_rank > 0 else []
    return linear, convs


# Modules that hold layers but are none, which peft cannot adapt. diffusers' attention keeps
# its output projection in `to_out`, a ModuleList of the Linear and a Dropout, so a target
# name can reach one beside the plain layers it names: "to_out" names Flux.2's single-stream
# blocks' fused output Linear (BFL's `linear2`) and its double-stream blocks' ModuleList.
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def target_pattern(targets: list[str], scope: str | None) -> str:
    """The suffixes as one regular expression over module paths (peft matches a string with
    `re.fullmatch`): a path that is a suffix or ends in "." + one, starting with `scope`."""
    suffixes = "|".join(re.escape(name) for name in targets)
    return rf"(?:{scope or ''})(?:.*\.)?(?:{suffixes})"


def scoped_targets(targets: list[str], scope: str | None) -> list[str] | str:
    """peft's `target_modules`: the suffixes as they are, or with a family's `lora_scope` one
    regular expression that matches them only in module paths starting with the scope."""
    return targets if scope is None else target_pattern(targets, scope)


def module_targets(module: nn.Module, targets: list[str], scope: str | None,
                   named: tuple[str, ...] = ()) -> list[str] | str:
    """peft's `target_modules` for `module`: `scoped_targets`, less the containers a name also
    matches (`CONTAINERS`), each left out by its path, so a name adapts the layers it names
    (Klein's "to_out": the single-stream blocks' output, not the double-stream blocks' lists,
    whose layer is "to_out.0"). Where no container matches (every target list peft could take
    before) the result is `scoped_targets`' own. A name that matches containers only names no
    layer: refused, naming a layer inside one. So is a name of `named` (the user's own list; the
    layers an adapter kind adds may be missing from a family) that matches no module at all."""
    pattern = target_pattern(targets, scope)
    containers = [name for name, layer in module.named_modules()
                  if isinstance(layer, CONTAINERS) and re.fullmatch(pattern, name)]
    problems = [problem for name in targets
                if (problem := _names_no_layer(module, name, scope, bool(containers),
                                               name in named))]
    if problems:
        raise ValueError("training.lora_target_modules: " + "; ".join(problems))
    if not containers:
        return scoped_targets(targets, scope)
    left_out = "|".join(re.escape(name) for name in containers)
    return rf"(?!(?:{left_out})$){pattern}"


def _names_no_layer(module: nn.Module, name: str, scope: str | None, containers: bool,
                    own: bool) -> str | None:
    """Why `name` adapts nothing: it is the user's own (`own`) and matches no module of the
    component (a misspelt name among others, which peft would pass over without a word), or
    every module it matches is a container (checked where `containers`: some target matched
    one). None when it matches a layer, or matches nothing and is not the user's."""
    if not own and not containers:
        return None  # neither question applies: no need to walk the modules
    pattern = target_pattern([name], scope)
    matched = [(path, layer) for path, layer in module.named_modules()
               if re.fullmatch(pattern, path)]
    if not matched:
        return _matches_nothing(module, name, scope) if own else None
    if not containers or not all(isinstance(layer, CONTAINERS) for _, layer in matched):
        return None
    path, layer = matched[0]
    inside = [f'"{name}.{child}"' for child, sub in layer.named_children()
              if isinstance(sub, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))]
    hint = f": name the layer inside, {' or '.join(inside)}" if inside else ""
    more = f" and {len(matched) - 1} more" if len(matched) > 1 else ""
    return (f'"{name}" matches only {type(layer).__name__}s ({path}{more}), which hold layers '
            f"but are none, so no adapter can go there{hint}")


def _matches_nothing(module: nn.Module, name: str, scope: str | None) -> str:
    """The refusal of a target name no module path ends in, with the layer names it may mean
    (the last parts of the component's layer paths, closest first)."""
    import difflib
    layers = {_last_name(path) for path, layer in module.named_modules()
              if isinstance(layer, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))}
    close = difflib.get_close_matches(name, sorted(layers), n=3, cutoff=0.5)
    where = " in the blocks this family adapts" if scope else ""
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return (f'"{name}" matches no layer of the {type(module).__name__}{where}, so no adapter '
            f"would go there{hint}")


def _last_name(path: str) -> str:
    """A layer's name as a target names it: its last part, with its list's name before an
    index (`to_out.0`)."""
    parts = path.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]


def peft_config(config: Config, denoiser: bool, scope: str | None = None,
                module: nn.Module | None = None):
    """The peft config of one component's adapters (the denoiser's or a text encoder's);
    `scope`: the family's `lora_scope` for the denoiser (None: every matching layer);
    `module`: the component, whose containers the targets then leave out (`module_targets`)."""
    import peft

    t = config.training
    adapter = adapter_of(config)
    row = ADAPTERS[adapter]
    linear, convs = target_modules(config, denoiser)
    # Patterns are peft suffixes: "conv1" sets the rank of every "...resnets.N.conv1".
    ranks = {name: t.conv_rank for name in convs}
    alphas = {name: t.conv_alpha for name in convs}
    targets = (scoped_targets(linear + convs, scope) if module is None
               else module_targets(module, linear + convs, scope,
                                   tuple(t.lora_target_modules) if denoiser else ()))
    common = dict(r=t.lora_rank, target_modules=targets, rank_pattern=ranks,
                  alpha_pattern=alphas)
    cls = getattr(peft, row.peft_config)
    if row.peft_config == "LoraConfig":
        return cls(lora_alpha=t.lora_alpha, init_lora_weights="gaussian",
                   use_rslora=t.use_rslora, use_dora=adapter == Adapter.DORA,
                   lora_dropout=t.lora_dropout, **common)
    extra = ({"decompose_factor": t.lokr_factor, "rank_dropout_scale": False}
             if adapter == Adapter.LOKR else {})
    return cls(alpha=t.lora_alpha, rank_dropout=t.rank_dropout,
               module_dropout=t.module_dropout, **extra, **common)


def add_adapter(module: ModelMixin | PreTrainedModel, config: Config, denoiser: bool,
                scope: str | None = None) -> None:
    """Inject the configured adapter into `module` in place (its parameters trainable);
    `scope`: where in the denoiser adapters may go (the family's `lora_scope`)."""
    module.add_adapter(peft_config(config, denoiser, scope, module))
    make_lycoris_layers_compilable(module)
    if config.training.adapter == Adapter.DORA:
        make_dora_traceable()


def make_dora_traceable() -> None:
    """Let TorchDynamo trace peft's DoRA layers without breaking the graph at each of them.

    peft's DoRA forward asks `dequantize_module_weight(base_layer)` for the base weight, and
    that helper tests `type(weight).__module__.startswith("torchao.")`, a string method
    TorchDynamo cannot trace (peft 0.21): 34 graph breaks in the tiny UNet, one per adapted
    layer, so a compiled DoRA ran mostly eager. The helper is replaced, in peft's DoRA module
    only, by one that returns a plain `nn.Parameter` weight at once and hands anything else
    (quantized weights) to peft's own. Same weights, same maths; called explicitly when a DoRA
    adapter is built, and idempotent."""
    from peft.tuners.lora import dora

    original = dora.dequantize_module_weight
    if getattr(original, "tempera_plain_weights", False):
        return

    def base_weight(module: nn.Module) -> nn.Parameter:
        weight = module.weight
        if type(weight) is nn.Parameter and not hasattr(module, "W_q"):
            return weight
        return original(module)

    setattr(base_weight, "tempera_plain_weights", True)  # the mark read with getattr above
    dora.dequantize_module_weight = base_weight


def _lycoris_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's LoHa/LoKr forward, with module dropout as a 0/1 factor on the update.

    peft decides module dropout with `if torch.rand(1) > p` on every training forward, even at
    p = 0: a branch on a tensor, which TorchDynamo can only handle by breaking the graph at
    every adapted layer. Multiplying by the same draw's outcome keeps the distribution (the
    update is kept with probability 1 - p, unscaled) and the graph whole; at p = 0 nothing is
    drawn. The update itself stays peft's (`_get_delta_activations`).
    """
    previous_dtype = x.dtype
    if self.disable_adapters and self.merged:
        self.unmerge()
    result = self.base_layer(x, *args, **kwargs)
    if self.disable_adapters or self.merged:
        return result.to(previous_dtype)
    for name in self.active_adapters:
        if name not in self._available_adapters:
            continue
        delta = self._get_delta_activations(name, x, *args, **kwargs)
        dropout = self.module_dropout[name]
        if self.training and dropout > 0:
            delta = delta * (torch.rand(1, device=delta.device) > dropout).to(delta.dtype)
        result = result + delta
    return result.to(previous_dtype)


_COMPILABLE: dict[type, type] = {}


def make_lycoris_layers_compilable(module: nn.Module) -> int:
    """Give every peft LoHa/LoKr layer in `module` the branch-free forward above; returns how
    many. A named, explicit step (not a patch of peft): each layer's class becomes a subclass
    of its own peft class that only overrides `forward`, so isinstance checks, state-dict keys
    and peft's maths are unchanged."""
    from peft.tuners.loha.layer import LoHaLayer
    from peft.tuners.lokr.layer import LoKrLayer

    count = 0
    for layer in module.modules():
        if isinstance(layer, (LoHaLayer, LoKrLayer)) and type(layer) not in _COMPILABLE.values():
            cls = type(layer)
            if cls not in _COMPILABLE:
                _COMPILABLE[cls] = type(cls.__name__, (cls,), {"forward": _lycoris_forward,
                                                               "__module__": __name__})
            layer.__class__ = _COMPILABLE[cls]
            count += 1
    return count


def uses_dropout(config: Config) -> bool:
    t = config.training
    return (t.method == TrainingMethod.LORA
            and (t.lora_dropout > 0 or t.module_dropout > 0 or t.rank_dropout > 0))


def seed_adapter_dropout(config: Config, step: int, rank: int) -> None:
    """Seed torch's global generator, which peft's dropout draws from, from (seed, rank, step)
    before a step: a resumed or retried step drops exactly what it dropped the first time,
    whatever ran before it. Nothing happens when no adapter dropout is on."""
    if uses_dropout(config):
        torch.manual_seed(derive_seed("adapter-dropout", config.training.seed, rank, step)
                          % 2**63)
