"""Which settings the config in hand leaves unused, and why: one table of rules.

A rule names fields and the condition under which they do anything; when it does not hold,
the GUI greys them and shows the reason (app/field_states.py). The conditions are read from
the tables that decide them elsewhere (modules/config/adapters.py for each adapter's options,
modules/config/optimizers.py for the optimizers that set their own step size or replace the
schedule), so a new adapter or optimizer row needs no new rule. Greying never refuses a value:
validation (modules/config/validate.py) still says when an unused value cannot stay as it is,
so a field the validator may ask to change (training.lr_scheduler, training.ema) is not greyed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from modules.config.adapters import ADAPTERS, OPTION_OFF, AdapterRow
from modules.config.optimizers import OPTIMIZERS, OptimizerRow
from modules.config.schema import (Config, LRScheduler, PredictionType, Sampler,
                                   TimestepSampling, TrainingMethod)
from modules.model_types import MODEL_TYPES


@dataclass(frozen=True)
class FieldRule:
    """`paths` do something only while `applies(config)`; otherwise `why(config)` says why."""
    paths: tuple[str, ...]
    applies: Callable[[Config], bool]
    why: Callable[[Config], str]


def _training(name: str) -> str:
    return f"training.{name}"


ADAPTER_FIELDS = tuple(_training(name) for name in (
    "adapter", "lora_rank", "lora_alpha", "lora_target_modules", "conv_rank", "conv_alpha",
    *OPTION_OFF))
# Each schedule's own setting: the schedule that reads it.
SCHEDULE_OPTIONS = {"training.lr_cycles": LRScheduler.COSINE_WITH_RESTARTS,
                    "training.lr_power": LRScheduler.POLYNOMIAL}
WARMUP_FIELDS = ("training.lr_warmup_steps", "training.lr_warmup_ratio")
TEXTUAL_INVERSION_FIELDS = tuple(f"textual_inversion.{name}" for name in (
    "placeholder", "vectors", "initializer"))
COMPONENT_TRAIN_FIELDS = tuple(f"components.{name}.train" for name in (
    "denoiser", "text_encoder", "text_encoder_2"))
SAMPLING_FIELDS = tuple(f"sampling.{name}" for name in (
    "sampler", "negative_prompt", "every_steps", "seed", "steps", "guidance_scale"))


def _adapter_row(config: Config) -> AdapterRow:
    return ADAPTERS[config.training.adapter]


def _having(option: str) -> str:
    """The adapters that have `option`, e.g. "LOHA / LOKR"."""
    return " / ".join(a.value for a, row in ADAPTERS.items() if option in row.options)


def _option_rule(option: str) -> FieldRule:
    """An adapter option (adapters.py's `options`) is used only by the adapters that list it."""
    return FieldRule(
        (_training(option),), lambda c: option in _adapter_row(c).options,
        lambda c: f"{_adapter_row(c).label} has no such option ({_having(option)} have it)")


def _schedule_rule(path: str, schedule: LRScheduler) -> FieldRule:
    return FieldRule((path,), lambda c: c.training.lr_scheduler == schedule,
                     lambda c: f"only the {schedule.value} schedule reads it "
                               f"({c.training.lr_scheduler.value} is chosen)")


def _optimizer(config: Config) -> OptimizerRow:
    return OPTIMIZERS[config.training.optimizer]


def _flow(config: Config) -> bool:
    return MODEL_TYPES[config.model.type].flow_matching


# Each objective's own settings and their off value, the one value a family trained with the
# other objective takes (validation refuses any other): greyed there only while off, so that
# validation's refusal can be undone, and taken when the model type changes (`only_values`).
FLOW_ONLY: dict[str, Any] = {"loss.timestep_sampling": TimestepSampling.UNIFORM,
                             "loss.timestep_shift": None, "loss.dynamic_shift": False}
DDPM_ONLY: dict[str, Any] = {"model.prediction_type": PredictionType.AUTO,
                             "model.zero_terminal_snr": False, "training.min_snr_gamma": 0.0,
                             "loss.debiased_estimation": False}


def _objective_rule(path: str, off: Any, flow: bool) -> FieldRule:
    """A setting of one objective (flow matching's when `flow`), used by its families, and
    left editable while set elsewhere so that validation's refusal can be undone."""
    def why(c: Config) -> str:
        label = MODEL_TYPES[c.model.type].label
        return (f"{label} is trained with DDPM; this shapes flow matching's noise levels"
                if flow else f"{label} is trained with flow matching, which has no DDPM "
                             "schedule")
    return FieldRule((path,), lambda c: _flow(c) == flow or attrgetter(path)(c) != off, why)


def _objective_rules() -> tuple[FieldRule, ...]:
    return (*(_objective_rule(p, s, True) for p, s in FLOW_ONLY.items()),
            *(_objective_rule(p, s, False) for p, s in DDPM_ONLY.items()))


# The settings some model types read and others do not (ModelTypeSpec.own_settings)
OWN_SETTINGS = tuple(dict.fromkeys(path for spec in MODEL_TYPES.values()
                                   for path in spec.own_settings))


def _own_setting_rule(path: str) -> FieldRule:
    """A setting only the model types that list it read (Z-Image's text encoder file)."""
    having = " / ".join(spec.label for spec in MODEL_TYPES.values() if path in spec.own_settings)
    return FieldRule((path,), lambda c: path in MODEL_TYPES[c.model.type].own_settings,
                     lambda c: f"{MODEL_TYPES[c.model.type].label} models do not read it "
                               f"({having} only)")


def only_values(config: Config) -> dict[str, Any]:
    """Dotted path -> value, for each setting the config's model type allows one value of:
    the other objective's settings (their off value) and the sampler of a family whose
    pipeline samples with one. The GUI sets them when the model type is changed; validation
    refuses any other value."""
    spec = MODEL_TYPES[config.model.type]
    values = dict(DDPM_ONLY if spec.flow_matching else FLOW_ONLY)
    if spec.samplers is not None and len(spec.samplers) == 1:
        values["sampling.sampler"] = Sampler(spec.samplers[0])
    return values


def _validation_off(config: Config) -> str:
    return "validation is off (validation.every_steps is 0)"


def _has_prompts(config: Config) -> bool:
    return bool(config.sampling.prompts or config.sampling.prompts_file)


# The first rule that does not hold gives a field's reason, so the broad ones come first.
RULES: tuple[FieldRule, ...] = (
    *(_own_setting_rule(path) for path in OWN_SETTINGS),
    FieldRule(ADAPTER_FIELDS, lambda c: c.training.method == TrainingMethod.LORA,
              lambda c: (f"{c.training.method.value} trains new token embeddings, with no "
                         "adapter" if c.training.method == TrainingMethod.TEXTUAL_INVERSION
                         else "FINE_TUNE trains the full weights, with no adapter")),
    FieldRule(TEXTUAL_INVERSION_FIELDS,
              lambda c: c.training.method == TrainingMethod.TEXTUAL_INVERSION,
              lambda c: f"only TEXTUAL_INVERSION reads it ({c.training.method.value} is chosen)"),
    FieldRule(COMPONENT_TRAIN_FIELDS,
              lambda c: c.training.method != TrainingMethod.TEXTUAL_INVERSION,
              lambda c: "TEXTUAL_INVERSION trains the new token's embeddings in every text "
                        "encoder, and nothing else"),
    *(_option_rule(option) for option in OPTION_OFF),
    FieldRule(("training.conv_rank", "training.conv_alpha"),
              lambda c: _adapter_row(c).convolutions,
              lambda c: f"{_adapter_row(c).label} adapts no convolution ("
                        + " / ".join(a.value for a, r in ADAPTERS.items() if r.convolutions)
                        + " do)"),
    FieldRule(("training.learning_rate", *WARMUP_FIELDS, *SCHEDULE_OPTIONS),
              lambda c: not _optimizer(c).own_step_size,
              lambda c: f"{_optimizer(c).label} sets its own step size"),
    FieldRule(tuple(SCHEDULE_OPTIONS), lambda c: not _optimizer(c).schedule_free,
              lambda c: f"{_optimizer(c).label} replaces the schedule"),
    *(_schedule_rule(path, schedule) for path, schedule in SCHEDULE_OPTIONS.items()),
    FieldRule(("training.ema_decay",), lambda c: c.training.ema,
              lambda c: "EMA is off"),
    FieldRule(("training.prior_loss_weight",),
              lambda c: any(d.regularization for d in c.data.datasets),
              lambda c: "no dataset is marked as regularisation images"),
    *_objective_rules(),
    FieldRule(("loss.logit_mean", "loss.logit_std"),
              lambda c: c.loss.timestep_sampling == TimestepSampling.LOGIT_NORMAL,
              lambda c: f"only LOGIT_NORMAL timestep sampling reads it "
                        f"({c.loss.timestep_sampling.value} is chosen)"),
    FieldRule(("data.bucket_max_aspect",), lambda c: c.data.aspect_buckets,
              lambda c: "aspect-ratio buckets are off"),
    FieldRule(SAMPLING_FIELDS, _has_prompts,
              lambda c: "there are no prompts, so nothing is sampled"),
    # greyed only while off: when on, validation asks to turn it off, so it stays editable
    FieldRule(("model.weight_storage",),
              lambda c: (c.training.method == TrainingMethod.LORA
                         or c.model.weight_storage.eight_bit),
              lambda c: "FINE_TUNE trains the weights themselves: 8-bit storage is for LoRA"),
    FieldRule(("model.offload_blocks",),
              lambda c: (c.training.method == TrainingMethod.LORA
                         or (c.training.method == TrainingMethod.FINE_TUNE
                             and c.training.fused_backward)
                         or c.model.offload_blocks != 0),
              lambda c: ("a full fine-tune offloads its blocks only with the fused "
                         "backward pass (training.fused_backward)"
                         if c.training.method == TrainingMethod.FINE_TUNE
                         else "block offload is for LoRA and full fine-tunes")),
    FieldRule(("validation.save_best",),
              lambda c: bool(c.validation.every_steps) or c.validation.save_best,
              _validation_off),
    # validation's images: greyed only while off and unset (set, validation asks to turn it
    # on or clear them, so they stay editable)
    FieldRule(("validation.split_ratio",),
              lambda c: bool(c.validation.every_steps) or c.validation.split_ratio > 0,
              _validation_off),
    FieldRule(("validation.folder",),
              lambda c: bool(c.validation.every_steps) or bool(c.validation.folder.strip()),
              _validation_off),
    FieldRule(("validation.timesteps", "validation.batch_size"),
              lambda c: bool(c.validation.every_steps), _validation_off),
)
RULED_PATHS = frozenset(path for rule in RULES for path in rule.paths)


def unused_fields(config: Config) -> dict[str, str]:
    """Dotted path -> why, for every ruled field the config leaves unused (the first rule
    that does not hold gives the reason)."""
    unused: dict[str, str] = {}
    for rule in RULES:
        if not rule.applies(config):
            why = rule.why(config)
            for path in rule.paths:
                unused.setdefault(path, why)
    return unused
