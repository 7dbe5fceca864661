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

from modules.config.adapters import ADAPTERS, OPTION_OFF, AdapterRow
from modules.config.optimizers import OPTIMIZERS, OptimizerRow
from modules.config.schema import Config, LRScheduler, TrainingMethod


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


def _has_prompts(config: Config) -> bool:
    return bool(config.sampling.prompts or config.sampling.prompts_file)


# The first rule that does not hold gives a field's reason, so the broad ones come first.
RULES: tuple[FieldRule, ...] = (
    FieldRule(ADAPTER_FIELDS, lambda c: c.training.method == TrainingMethod.LORA,
              lambda c: "FINE_TUNE trains the full weights, with no adapter"),
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
    FieldRule(("data.bucket_max_aspect",), lambda c: c.data.aspect_buckets,
              lambda c: "aspect-ratio buckets are off"),
    FieldRule(SAMPLING_FIELDS, _has_prompts,
              lambda c: "there are no prompts, so nothing is sampled"),
    # greyed only while off: when on, validation asks to turn it off, so it stays editable
    FieldRule(("validation.save_best",),
              lambda c: bool(c.validation.every_steps) or c.validation.save_best,
              lambda c: "validation is off (validation.every_steps is 0)"),
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
