"""The noise and loss options checked against the model family and the loaded model.

`validate` (config layer) checks what the config alone decides; what depends on the family's
noise process (does it have a DDPM SNR, a beta schedule to rescale?) is checked here before
the model is loaded (`family_problems`, from `check_run`), and what depends on the loaded
model (its resolved prediction type, its number of training timesteps) right after it is
loaded (`model_problems`, from `prepare_run`).
"""
from __future__ import annotations

from modules.config.loss import HuberSchedule, LossType
from modules.config.problems import Problem
from modules.config.schema import Adapter, Config, SaveFormat, TrainingMethod
from modules.model_types import MODEL_TYPES
from modules.models.families import family_of
from modules.models.bundle import ModelBundle
from modules.models.single_file import schedule_markers
from modules.train.recipe.textual_inversion import (is_textual_inversion, token_problems,
                                                    tokenizers_by_encoder)


# the adapters whose layers cannot be fused into one LoRA of a fused weight
UNFUSABLE = (Adapter.LOHA, Adapter.LOKR, Adapter.DORA)
# of those, the ones a family writes unfused under other names where its record gives them
# (FileConventions.kohya_unfused_prefixes: Klein's `lycoris_` names, which ComfyUI applies to
# their rows of the fused weight); DoRA is not: its update depends on the base weight's norm
# per row, and its application to a fused weight's rows was not verified with ComfyUI
WRITTEN_UNFUSED = (Adapter.LOHA, Adapter.LOKR)


def snr_options(config: Config) -> list[tuple[str, str, str]]:
    """(dotted path, what it should be, what it is) of each option on that reads the SNR."""
    loss, on = config.loss, []
    if config.training.min_snr_gamma:
        on.append(("training.min_snr_gamma", "0", f"{config.training.min_snr_gamma:g}"))
    if loss.debiased_estimation:
        on.append(("loss.debiased_estimation", "false", "true"))
    if loss.loss_type != LossType.MSE and loss.huber_schedule == HuberSchedule.SNR:
        on.append(("loss.huber_schedule", "CONSTANT or EXPONENTIAL", "SNR"))
    return on


def family_problems(config: Config) -> list[Problem]:
    """Options the model family's noise process cannot serve (e.g. min-SNR for a flow-matching
    family, whose objective has no DDPM SNR)."""
    objective = family_of(config.model.type).objective
    label = MODEL_TYPES[config.model.type].label
    problems = []
    if objective.snr is None:
        problems += [Problem(path, expected, given, f"{label} models have no DDPM "
                             "signal-to-noise ratio to weigh the loss by")
                     for path, expected, given in snr_options(config)]
    if objective.zero_terminal_snr is None and config.model.zero_terminal_snr:
        problems.append(Problem("model.zero_terminal_snr", "false", "true",
                                f"{label} models have no DDPM beta schedule to rescale"))
    files = family_of(config.model.type).files
    if files is None:  # no kohya or single-file layout (yet)
        problems += [Problem(f"output.formats[{i}]", "DIFFUSERS", fmt.value,
                             f"{label} has no {fmt.value} file layout yet; its weights are "
                             "written as a diffusers folder / LoRA file")
                     for i, fmt in enumerate(config.output.formats)
                     if fmt in (SaveFormat.KOHYA, SaveFormat.SINGLE_FILE)]
    problems += _unfusable_problems(config, label)
    return problems


def _unfusable_problems(config: Config, label: str) -> list[Problem]:
    """An adapter with no fused form, with KOHYA output for a family whose kohya layout fuses
    layers and that has no unfused layout for it."""
    files = family_of(config.model.type).files
    adapter = config.training.adapter
    if (files is None or not files.kohya_fuses or SaveFormat.KOHYA not in config.output.formats
            or config.training.method != TrainingMethod.LORA or adapter not in UNFUSABLE):
        return []
    if adapter in WRITTEN_UNFUSED and files.kohya_unfused_prefixes:
        return []
    why = ("its update rescales each row of W + dW by the base weight's norm, and ComfyUI's "
           "application of it to its rows of the fused weight was not verified"
           if adapter == Adapter.DORA else "only a LoRA's has one")
    return [Problem(
        "training.adapter", "LORA (or output.formats without KOHYA)", adapter.value,
        f"{label}'s ComfyUI LoRA layout fuses {files.kohya_fuses}, and a "
        f"{adapter.value} layer has no fused form ({why})")]


def model_problems(config: Config, bundle: ModelBundle) -> list[Problem]:
    """Options the loaded model cannot serve: a timestep range beyond its schedule, zero
    terminal SNR on a model that (with prediction type AUTO) turned out to predict epsilon,
    or left off for a checkpoint marked as trained with it; a TEXTUAL_INVERSION token its
    tokenizers refuse."""
    problems = []
    steps = family_of(bundle.model_type).objective.train_timesteps(bundle)
    if config.loss.max_timestep > steps:
        problems.append(Problem("loss.max_timestep", f"at most {steps} (this model's number of "
                                "training timesteps)", str(config.loss.max_timestep)))
    if config.model.zero_terminal_snr and bundle.prediction_type != "v_prediction":
        problems.append(Problem("model.prediction_type", "V_PREDICTION with "
                                "model.zero_terminal_snr", f"{config.model.prediction_type.value} "
                                f"(this model predicts {bundle.prediction_type})",
                                "zero terminal SNR needs a v-prediction model; set "
                                "V_PREDICTION if it is one, or turn model.zero_terminal_snr off"))
    if not config.model.zero_terminal_snr and "ztsnr" in schedule_markers(config.model.path):
        problems.append(Problem("model.zero_terminal_snr", "true for this checkpoint", "false",
                                "it carries the ztsnr marker: it was trained on a "
                                "zero-terminal-SNR schedule, and training it on the plain one "
                                "would work against that"))
    if is_textual_inversion(config):  # before anything is written (prepare_run)
        problems += token_problems(config, tokenizers_by_encoder(bundle))
    return problems
