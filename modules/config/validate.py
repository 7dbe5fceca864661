"""`validate(config)`: the one consistency check used by the CLI, the GUI and cloud runs.

Type and range errors are caught when a config is loaded; this finds combinations that do not
make sense and inputs on disk that are missing, each as a Problem with its dotted path.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math

from modules.config.adapters import ADAPTERS, OPTION_OFF
from modules.config.optimizers import OPTIMIZERS
from modules.config.problems import Problem
from modules.config.prompts import sample_prompts
from modules.config.wandb_settings import check_wandb
from modules.config.schema import (
    Adapter,
    BUILTIN_PREFIX,
    BUILTIN_SHAPES,
    CompileScope,
    Config,
    DataConfig,
    Device,
    DistributedStrategy,
    DType,
    LOKR_FACTORS,
    LRScheduler,
    MixedPrecision,
    Optimizer,
    PredictionType,
    SaveFormat,
    TrainingConfig,
    TrainingMethod,
    ValidationConfig,
    WeightStorage,
)
from modules.geometry import bucket_sizes, narrowest_non_square
from modules.config.loss import TimestepSampling
from modules.model_types import BUILTIN_DATASETS, MODEL_TYPES

SUPPORTED_FORMATS = {
    TrainingMethod.LORA: {SaveFormat.DIFFUSERS, SaveFormat.KOHYA},
    TrainingMethod.FINE_TUNE: {SaveFormat.DIFFUSERS, SaveFormat.SINGLE_FILE},
    # DIFFUSERS: learned_embeds.safetensors (load_textual_inversion); KOHYA: the A1111 /
    # ComfyUI embedding file kohya's sd-scripts write (emb_params, or clip_l / clip_g)
    TrainingMethod.TEXTUAL_INVERSION: {SaveFormat.DIFFUSERS, SaveFormat.KOHYA},
}
COMPONENT_NAMES = ("denoiser", "text_encoder", "text_encoder_2", "vae")
RESOLUTION_RANGE = next((int(f.metadata["min"]), int(f.metadata["max"]))
                        for f in dataclasses.fields(DataConfig) if f.name == "resolution")
BUCKET_MAX_ASPECT_LIMIT = next(f.metadata["max"] for f in dataclasses.fields(DataConfig)
                               if f.name == "bucket_max_aspect")


def validate(config: Config) -> list[Problem]:
    """Every problem with the config's values and combinations. Nothing on disk is opened: the
    inputs themselves (model, datasets, output folder) are checked by
    `modules.train.setup.inputs.check_inputs` when a run is prepared or `--check`ed."""
    problems: list[Problem] = []
    problems += _check_components(config)
    problems += _check_training(config)
    problems += _check_adapter(config)
    problems += _check_data(config)
    problems += _check_regularization(config)
    problems += _check_output_and_sampling(config)
    problems += _check_builtin_names(config)
    problems += _check_noise_and_loss(config)
    problems += _check_objective_options(config)
    problems += _check_validation(config)
    problems += _check_weight_storage(config)
    problems += check_wandb(config.logging)
    problems += _check_textual_inversion(config)
    problems += _check_distributed_strategy(config)
    problems += fused_backward_problems(config)
    problems += _check_block_offload(config)
    return problems


def _check_textual_inversion(config: Config) -> list[Problem]:
    """TEXTUAL_INVERSION's token and the options it cannot run with (what needs the tokenizer,
    a placeholder it already knows or an initializer outside its vocabulary, is checked when
    the tokens are added: train/recipe/textual_inversion.py)."""
    if config.training.method != TrainingMethod.TEXTUAL_INVERSION:
        return []
    ti, spec, problems = config.textual_inversion, MODEL_TYPES[config.model.type], []
    if spec.flow_matching or not all(n.startswith("text_encoder") for n in spec.text_encoders):
        problems.append(Problem("training.method", "LORA or FINE_TUNE for " + spec.label,
                                "TEXTUAL_INVERSION",
                                f"textual inversion trains new rows of CLIP's token "
                                f"embedding (SD 1.x / 2.x, SDXL); {spec.label}'s text encoder "
                                "is a chat language model whose prompts A1111 / ComfyUI "
                                "embeddings do not address"))
    placeholder = ti.placeholder
    if not placeholder.strip():
        problems.append(Problem("textual_inversion.placeholder", "a trigger word such as "
                                "<mychar>", repr(placeholder),
                                "the new token is written in captions and prompts"))
    elif placeholder != placeholder.strip() or any(ch.isspace() for ch in placeholder):
        problems.append(Problem("textual_inversion.placeholder", "one word without spaces, "
                                "e.g. <mychar>", repr(placeholder),
                                "the tokenizer splits text at spaces, so a trigger word "
                                "with a space could never be read as one token"))
    if not ti.initializer.strip():
        problems.append(Problem("textual_inversion.initializer", "a word such as 'person' or "
                                "'style'", repr(ti.initializer),
                                "the new vectors start from its embedding"))
    if config.data.cache_text_encoder_outputs:
        problems.append(Problem("data.cache_text_encoder_outputs",
                                "false with TEXTUAL_INVERSION", "true",
                                "the trained token embedding changes the text encoder's "
                                "outputs every step"))
    return problems


def _check_objective_options(config: Config) -> list[Problem]:
    """The options of one objective set for a family trained on the other: flow matching's
    sigma draws for a DDPM family; DDPM's prediction type and the DDPM samplers for a
    flow-matching family (its SNR and beta-schedule options: train/recipe/loss_checks.py)."""
    spec, loss, problems = MODEL_TYPES[config.model.type], config.loss, []
    if not spec.flow_matching:
        why = (f"{spec.label} trains on DDPM's integer timesteps, drawn uniformly; this shapes "
               "the noise level sigma of flow-matching families (Z-Image)")
        if loss.timestep_sampling != TimestepSampling.UNIFORM:
            problems.append(Problem("loss.timestep_sampling", "UNIFORM",
                                    loss.timestep_sampling.value, why))
        if loss.timestep_shift is not None:
            problems.append(Problem("loss.timestep_shift", "empty",
                                    f"{loss.timestep_shift:g}", why))
        if loss.dynamic_shift:
            problems.append(Problem("loss.dynamic_shift", "false", "true", why))
        return problems
    if loss.dynamic_shift and loss.timestep_shift is not None:
        problems.append(Problem("loss.timestep_shift", "empty with loss.dynamic_shift",
                                f"{loss.timestep_shift:g}", "the resolution-dependent shift "
                                "replaces the fixed one: set one of the two"))
    if config.model.prediction_type != PredictionType.AUTO:
        problems.append(Problem("model.prediction_type", "AUTO",
                                config.model.prediction_type.value,
                                f"{spec.label} is trained with flow matching: it predicts the "
                                "velocity from the image to the noise, and epsilon or v "
                                "prediction are DDPM's"))
    samples = bool(config.sampling.prompts or config.sampling.prompts_file)
    if samples and spec.samplers is not None and config.sampling.sampler.value not in spec.samplers:
        problems.append(Problem("sampling.sampler", " or ".join(spec.samplers),
                                config.sampling.sampler.value,
                                f"{spec.label} samples with the flow-matching Euler scheduler "
                                "(FlowMatchEulerDiscreteScheduler); the others are DDPM "
                                "samplers"))
    return problems


def _check_weight_storage(config: Config) -> list[Problem]:
    """8-bit storage (FLOAT8, INT8 through torchao; W8A8's int8 matmuls) holds frozen weights
    only (docs/memory.md). Whether the device multiplies int8 is the memory check's question
    (train/memory/levers.py: validation opens no device)."""
    storage = config.model.weight_storage
    if not storage.eight_bit:
        return []
    if config.training.method == TrainingMethod.FINE_TUNE:
        why = ("its 3-bit mantissa" if storage == WeightStorage.FLOAT8
               else "its 256 levels a row")
        if storage == WeightStorage.W8A8:
            return [Problem("model.weight_storage", "WEIGHT_DTYPE with FINE_TUNE", storage.value,
                            "a full fine-tune trains the denoiser's linear layers themselves, "
                            "and W8A8 multiplies frozen int8 copies of them (a trained weight is "
                            "never stored in 8 bits: its 256 levels a row would swallow the "
                            "updates, and the int8 matmul gives no weight gradient); use "
                            "training.method=LORA, or WEIGHT_DTYPE")]
        return [Problem("model.weight_storage", "WEIGHT_DTYPE with FINE_TUNE", storage.value,
                        "a full fine-tune trains the weights themselves, and trained weights "
                        f"are never stored in 8 bits ({why} would swallow the updates); use "
                        "training.method=LORA, or model.weight_dtype=BFLOAT16")]
    if config.training.method == TrainingMethod.TEXTUAL_INVERSION:
        return [Problem("model.weight_storage", "WEIGHT_DTYPE with TEXTUAL_INVERSION",
                        storage.value, "8-bit storage is built for LoRA runs (the frozen layers "
                        "under the adapters); a textual inversion would keep every weight at "
                        "model.weight_dtype anyway, so the setting would do nothing; use "
                        "WEIGHT_DTYPE (model.weight_dtype=BFLOAT16 halves the frozen weights)")]
    if storage == WeightStorage.W8A8 and config.training.adapter == Adapter.DORA:
        return [Problem("model.weight_storage", "WEIGHT_DTYPE with training.adapter=DORA",
                        storage.value, "DoRA normalizes the base weight plus the adapter per "
                        "row, and peft reads the int8 values as the weight (it knows torchao's "
                        "and bitsandbytes' weights, not W8A8's); use LORA, LOCON, LOHA or "
                        "LOKR, or model.weight_storage=INT8")]
    if storage.torchao and importlib.util.find_spec("torchao") is None:
        return [Problem("model.weight_storage", "WEIGHT_DTYPE (torchao is not installed)",
                        storage.value, "pip install torchao (or tempera[memory]), or use "
                        "WEIGHT_DTYPE")]
    return []


def _check_distributed_strategy(config: Config) -> list[Problem]:
    """FSDP shards a full fine-tune; what it cannot be combined with yet, each with why
    (docs/cloud.md, "Multi-GPU")."""
    t = config.training
    if t.distributed_strategy != DistributedStrategy.FSDP:
        return []
    path, given = "training.distributed_strategy", "FSDP"
    if t.method == TrainingMethod.TEXTUAL_INVERSION:
        return [Problem(path, "DDP with training.method TEXTUAL_INVERSION", given,
                        "textual inversion trains a few rows of the token embedding: every "
                        "process holds them whole and DDP averages their gradients; FSDP "
                        "shards a full fine-tune (set training.distributed_strategy=DDP)")]
    if t.method != TrainingMethod.FINE_TUNE:
        return [Problem(path, "DDP with training.method LORA", given,
                        f"{t.adapter.value} adapters are small: every process holds them whole "
                        "and DDP averages their gradients, which is the right tool; FSDP "
                        "shards a full fine-tune (set training.distributed_strategy=DDP, or "
                        "training.method=FINE_TUNE)")]
    problems = []
    if t.ema:
        problems.append(Problem(path, "DDP with training.ema", given,
                                "the EMA keeps a whole copy of every trained weight and reads "
                                "them unsharded, which FSDP's sharded weights are not; turn "
                                "training.ema off, or use DDP"))
    why_not = OPTIMIZERS[t.optimizer].under_fsdp
    if why_not:
        usable = ", ".join(o.value for o, row in OPTIMIZERS.items() if not row.under_fsdp)
        problems.append(Problem("training.optimizer", f"{usable} with FSDP", t.optimizer.value,
                                f"{OPTIMIZERS[t.optimizer].label} under FSDP: {why_not}; use "
                                f"{usable}, or training.distributed_strategy=DDP"))
    if t.mixed_precision == MixedPrecision.FP16:
        problems.append(Problem(path, "DDP with training.mixed_precision FP16", given,
                                "FLOAT16's GradScaler unscales each process's gradient shard "
                                "alone, so the processes would disagree on skipping a step; "
                                "use BF16 or NO mixed precision, or DDP"))
    return problems


def fsdp_problems(config: Config) -> list[Problem]:
    """What FSDP cannot combine with in `config` as it is set (the memory check asks before
    offering `training.distributed_strategy=FSDP` as a lever)."""
    return _check_distributed_strategy(config)


# optimizers the fused backward pass refuses, and why (per-weight optimizers would change them)
FUSED_REFUSED = {
    Optimizer.PRODIGY: "Prodigy estimates one step size from all the weights together; one "
                       "optimizer per weight would give each its own",
    Optimizer.SCHEDULE_FREE_ADAMW: "schedule-free AdamW switches its weights between the "
                                   "averaged and the trained ones around sampling, for the "
                                   "whole optimizer at once",
}
FUSED_OFF = "or set training.fused_backward=false"


def fused_backward_problems(config: Config) -> list[Problem]:
    """What the fused backward pass cannot combine with (train/recipe/fused.py, docs/memory.md);
    several processes and CUDA graphs are refused when the run starts."""
    t = config.training
    if not t.fused_backward:
        return []
    field = "training.fused_backward"
    problems = []
    if t.method != TrainingMethod.FINE_TUNE:
        problems.append(Problem(field, "false with LORA", "true",
                                "the fused pass is for full fine-tunes, whose gradients are as "
                                "large as the model; a LoRA's are small: use "
                                f"training.method=FINE_TUNE, {FUSED_OFF}"))
    if t.gradient_accumulation > 1:
        problems.append(Problem(field, "training.gradient_accumulation=1", "true",
                                f"gradient_accumulation is {t.gradient_accumulation}: the fused "
                                "pass steps each weight as its gradient is ready and frees it, "
                                "so there is no gradient to accumulate into; set "
                                "training.gradient_accumulation=1 (a larger "
                                f"training.batch_size instead), {FUSED_OFF}"))
    if t.mixed_precision == MixedPrecision.FP16:
        problems.append(Problem(field, "BF16 or NO mixed precision", "true with FP16",
                                "FP16's gradient scaler unscales and checks all gradients "
                                "before any weight steps; set training.mixed_precision=BF16, "
                                f"{FUSED_OFF}"))
    if t.optimizer in FUSED_REFUSED:
        problems.append(Problem(field, f"another optimizer than {t.optimizer.value}", "true",
                                f"{FUSED_REFUSED[t.optimizer]}; set training.optimizer=ADAMW, "
                                f"{FUSED_OFF}"))
    elif config.model.train_dtype == DType.BFLOAT16 and t.optimizer != Optimizer.ADAMW:
        problems.append(Problem(field, "optimizer ADAMW with bfloat16 trained weights", "true",
                                f"bfloat16 weights step with stochastic rounding, which only "
                                f"torchao's AdamW offers, not {t.optimizer.value}; set "
                                "training.optimizer=ADAMW, model.train_dtype=FLOAT32, "
                                f"{FUSED_OFF}"))
    elif (config.model.train_dtype == DType.BFLOAT16
          and importlib.util.find_spec("torchao") is None):
        problems.append(Problem(field, "torchao installed (bfloat16 stochastic rounding)",
                                "true", "pip install torchao (or tempera[memory]), or set "
                                f"model.train_dtype=FLOAT32, {FUSED_OFF}"))
    return problems


def _check_block_offload(config: Config) -> list[Problem]:
    """Block offload streams weights around REGIONAL-compiled blocks (docs/memory.md): a
    LoRA's frozen ones, at whatever `model.weight_storage` stores them
    (tests/train/test_block_offload_8bit.py), or a full fine-tune's trained ones too,
    stepped on the host by the fused backward pass (train/memory/offload_trained.py)."""
    if config.model.offload_blocks == 0:
        return []
    if (config.training.method == TrainingMethod.FINE_TUNE
            and not config.training.fused_backward):
        return [Problem("model.offload_blocks", "0 with FINE_TUNE without the fused backward",
                        str(config.model.offload_blocks),
                        "a full fine-tune's offloaded weights step on the host as soon as "
                        "their gradients are ready, which only the fused backward pass does "
                        "(an evicted block's device copy is dropped, never stepped); set "
                        "training.fused_backward=true (gradient_accumulation 1), or 0")]
    if config.compile.denoiser and config.compile.scope == CompileScope.FULL:
        return [Problem("model.offload_blocks", "0 with compile.scope=FULL",
                        str(config.model.offload_blocks),
                        "the transfers run around each block's call, outside compiled code, "
                        "and a whole-model compile would trace them; use compile.scope=REGIONAL")]
    return []


def _check_noise_and_loss(config: Config) -> list[Problem]:
    """Combinations of the noise and loss options that cannot work (what depends on the model
    family or the loaded model is `modules.train.recipe.loss_checks`')."""
    loss, problems = config.loss, []
    if loss.min_timestep >= loss.max_timestep:
        problems.append(Problem("loss.min_timestep", f"less than loss.max_timestep "
                                f"({loss.max_timestep})", str(loss.min_timestep),
                                "timesteps are drawn from [min_timestep, max_timestep)"))
    if loss.adaptive_noise_scale and not config.training.noise_offset:
        problems.append(Problem("loss.adaptive_noise_scale", "0 while training.noise_offset is 0",
                                f"{loss.adaptive_noise_scale:g}", "the adaptive scale adds to the "
                                "noise offset: set training.noise_offset (0.05 to 0.1) too"))
    if config.model.zero_terminal_snr and config.model.prediction_type == PredictionType.EPSILON:
        problems.append(Problem("model.prediction_type", "V_PREDICTION with "
                                "model.zero_terminal_snr", "EPSILON", "at the last timestep the "
                                "input is pure noise, from which the noise itself is trivially "
                                "known and the image cannot be recovered; use V_PREDICTION or "
                                "turn model.zero_terminal_snr off"))
    return problems


def _check_validation(config: Config) -> list[Problem]:
    """Validation needs exactly one source of images, and images given need a schedule;
    keeping the best weights needs a score. Counts (a fraction that leaves a side empty) are
    known after the scan: validation_set.py."""
    v = config.validation
    best = ([Problem("validation.save_best", "false while validation.every_steps is 0", "true",
                     "with validation off there is no score to pick the best step by: set "
                     "validation.every_steps (and a split_ratio or folder), or turn "
                     "save_best off")]
            if v.save_best and not v.every_steps else [])
    return best + _validation_source(v)


def _validation_source(v: ValidationConfig) -> list[Problem]:
    """Exactly one source of validation images, and a schedule for the images given."""
    source = v.split_ratio > 0 or bool(v.folder.strip())
    if v.split_ratio > 0 and v.folder.strip():
        return [Problem("validation.folder", "empty when validation.split_ratio is set",
                        repr(v.folder), "hold out a fraction or use a folder, not both")]
    if v.every_steps and not source:
        return [Problem("validation.every_steps", "0, or validation.split_ratio > 0 or a "
                        "validation.folder to score", str(v.every_steps),
                        "there are no validation images")]
    if source and not v.every_steps:
        given = (f"split_ratio {v.split_ratio:g}" if v.split_ratio > 0
                 else f"folder {v.folder!r}")
        return [Problem("validation.every_steps", f"at least 1 when {given} is set", "0",
                        "the validation images would never be scored" +
                        (" (and never trained)" if v.split_ratio > 0 else ""))]
    return []


def _check_builtin_names(config: Config) -> list[Problem]:
    """`builtin:` model and dataset names, and a built-in model's type (no file is opened)."""
    problems = []
    path = config.model.path
    builtins = {s.builtin: t for t, s in MODEL_TYPES.items()}
    if path.startswith(BUILTIN_PREFIX):
        if path not in builtins:
            problems.append(Problem("model.path", "one of " + ", ".join(builtins), repr(path)))
        elif builtins[path] != config.model.type:
            problems.append(Problem("model.type", builtins[path].value, config.model.type.value,
                                    f"{path} is a {MODEL_TYPES[builtins[path]].label} model"))
    for i, ds in enumerate(config.data.datasets):
        if ds.path.startswith(BUILTIN_PREFIX) and ds.path not in BUILTIN_DATASETS:
            problems.append(Problem(f"data.datasets[{i}].path",
                                    "one of " + ", ".join(BUILTIN_DATASETS), repr(ds.path)))
    return problems


def _check_components(config: Config) -> list[Problem]:
    spec = MODEL_TYPES[config.model.type]
    problems = []
    for name in COMPONENT_NAMES:
        component = getattr(config.components, name)
        if component.train and name not in spec.config_keys:
            problems.append(Problem(f"components.{name}.train", "false",
                                    "true", f"{spec.label} has no {name}"))
    if config.components.vae.train:
        problems.append(Problem("components.vae.train", "false", "true",
                                "Tempera trains the denoiser and text encoders, not the VAE"))
    # The VAE is never trained, so training only the VAE also means nothing would be trained.
    # (TEXTUAL_INVERSION trains the token embeddings whatever the components say.)
    if config.training.method != TrainingMethod.TEXTUAL_INVERSION and not any(getattr(config.components, n).train for n in spec.config_keys if n != "vae"):
        problems.append(Problem("components", "at least one component with train = true",
                                "none", "nothing would be trained"))
    return problems


def _check_training(config: Config) -> list[Problem]:
    t = config.training
    problems = []
    if t.method == TrainingMethod.LORA and not t.lora_target_modules:
        problems.append(Problem("training.lora_target_modules", "at least one module name",
                                "[]", "LoRA needs layers to adapt"))
    problems += _check_optimizer(config)
    if config.general.device == Device.CPU and t.mixed_precision == MixedPrecision.FP16:
        problems.append(Problem("training.mixed_precision", "NO or BF16 on the CPU", "FP16",
                                "FP16 autocast needs a CUDA GPU"))
    if config.general.device == Device.CUDA and not _cuda_available():
        problems.append(Problem("general.device", "AUTO or CPU (no CUDA GPU is visible)",
                                "CUDA"))
    return problems + _check_warmup(t) + _check_learning_rates(config)


def _check_adapter(config: Config) -> list[Problem]:
    """The adapter's options and save formats are ones it has (modules/config/adapters.py)."""
    t = config.training
    if t.method != TrainingMethod.LORA:
        return []
    name, row = t.adapter.value, ADAPTERS[t.adapter]
    problems = []
    for option, off in OPTION_OFF.items():
        value = getattr(t, option)
        if option not in row.options and value != off:
            having = [a.value for a, r in ADAPTERS.items() if option in r.options]
            problems.append(Problem(f"training.{option}", f"{json.dumps(off)} with {name}",
                                    json.dumps(value),
                                    f"{row.label} has no such option; "
                                    f"{' / '.join(having)} have it"))
    if t.conv_rank and not row.convolutions:
        problems.append(Problem("training.conv_rank", f"0 with {name}", str(t.conv_rank),
                                "LoRA adapts the attention layers only; use LOCON to adapt "
                                "the convolutions too"))
    if "lokr_factor" in row.options and t.lokr_factor in (0, 1):
        problems.append(Problem("training.lokr_factor", f"-1 (the balanced split) or "
                                f"{LOKR_FACTORS[0]} to {LOKR_FACTORS[1]}", str(t.lokr_factor),
                                "a factor of 0 or 1 leaves the Kronecker product's small "
                                "factor 1 x 1; docs/adapters.md says what the factor does"))
    if row.needs_convolutions and not t.conv_rank:
        problems.append(Problem("training.conv_rank", f"at least 1 with {name} (4 to 16 is "
                                "usual)", "0", f"{row.label} without convolutions is LORA "
                                "with more training.lora_target_modules"))
    formats = set(row.formats)
    if name in MODEL_TYPES[config.model.type].diffusers_adapters:
        formats.add(SaveFormat.DIFFUSERS)  # this type's pipeline loads its diffusers file
    for i, fmt in enumerate(config.output.formats):
        if fmt in SUPPORTED_FORMATS[t.method] and fmt not in formats:
            problems.append(Problem(f"output.formats[{i}]", " or ".join(
                sorted(f.value for f in formats)), fmt.value,
                f"diffusers cannot load {row.label} files; use KOHYA "
                f"({MODEL_TYPES[config.model.type].kohya_readers} read it)"))
    return problems


def _check_optimizer(config: Config) -> list[Problem]:
    """The optimizer's package is installed, its device is there, and a schedule is not set
    for one that ignores it (modules/config/optimizers.py says which)."""
    t = config.training
    row, name = OPTIMIZERS[t.optimizer], t.optimizer.value
    # The device first: installing the package would only lead to this refusal.
    if row.needs_cuda and config.general.device == Device.CPU:
        return [Problem("training.optimizer", "an optimizer that runs on the CPU", name,
                        f"{row.label} needs a CUDA GPU; use ADAMW")]
    missing = row.package and importlib.util.find_spec(row.module.split(".")[0]) is None
    if missing:
        fix = (f"{row.label} runs on a CUDA GPU only: on a machine with one, pip install "
               f"{row.package}; otherwise use ADAMW" if row.needs_cuda
               else f"pip install {row.package}, or use ADAMW")
        return [Problem("training.optimizer", f"ADAMW ({row.package} is not installed)", name,
                        fix)]
    if row.schedule_free and t.ema:
        return [Problem("training.ema", f"false with {name}", "true",
                        "schedule-free AdamW averages the weights itself")]
    if row.lr_range and not row.lr_range[0] <= t.learning_rate <= row.lr_range[1]:
        low, high = row.lr_range
        return [Problem("training.learning_rate", f"{low:g} to {high:g} with {name} (1.0 is "
                        "usual)", f"{t.learning_rate:g}", f"{row.label} finds the step size "
                        "itself; the learning rate only scales it")]
    if (row.schedule_free or row.own_step_size) and (
            t.lr_scheduler != LRScheduler.CONSTANT):
        why = ("schedule-free AdamW replaces the schedule" if row.schedule_free else
               "it sets its own step size and ignores the learning rate")
        return [Problem("training.lr_scheduler", f"CONSTANT with {name}", t.lr_scheduler.value,
                        why)]
    return []


def _check_warmup(t: TrainingConfig) -> list[Problem]:
    """The warm-up is set one way (as steps or as a ratio of the run) and ends within the run
    (a run counted in epochs is checked once its length is known: recipe.setup warns)."""
    if t.lr_warmup_ratio and t.lr_warmup_steps:
        return [Problem("training.lr_warmup_ratio", "0 while training.lr_warmup_steps is set",
                        f"{t.lr_warmup_ratio:g}", "set the warm-up as steps or as a ratio, "
                        "not both")]
    if OPTIMIZERS[t.optimizer].own_step_size:
        return []  # no learning rate is used, so no warm-up either
    if t.max_steps and t.lr_warmup_steps > t.max_steps:
        return [Problem("training.lr_warmup_steps", f"at most training.max_steps "
                        f"({t.max_steps})", str(t.lr_warmup_steps),
                        f"the rate would still be rising when the run ends, at "
                        f"{t.max_steps / t.lr_warmup_steps:.0%} of training.learning_rate: "
                        "lower the warm-up (a few percent of the run is usual) or set it as "
                        "training.lr_warmup_ratio")]
    return []


def _check_learning_rates(config: Config) -> list[Problem]:
    """A learning rate of 0 changes no weight: the run would "finish" with untrained weights
    (an optimizer that sets its own step size ignores the rate; one with a range of its own
    says so in `_check_optimizer`)."""
    t = config.training
    row = OPTIMIZERS[t.optimizer]
    if row.own_step_size:
        return []
    spec = MODEL_TYPES[config.model.type]
    trained = [name for name in spec.config_keys
               if name != "vae" and getattr(config.components, name).train]
    problems = []
    if (t.learning_rate == 0 and not row.lr_range
            and any(getattr(config.components, n).learning_rate is None for n in trained)):
        problems.append(Problem("training.learning_rate", "above 0 (1e-4 is usual for a LoRA, "
                                "1e-5 for a fine-tune)", "0", "a rate of 0 changes no weight: "
                                "the run would end with its weights as they started"))
    for name in trained:
        if getattr(config.components, name).learning_rate == 0:
            problems.append(Problem(f"components.{name}.learning_rate", "above 0, or empty "
                                    "(the training learning rate)", "0",
                                    f"a rate of 0 trains nothing; to leave the {name} as it "
                                    f"is, set components.{name}.train = false"))
    return problems


def _check_data(config: Config) -> list[Problem]:
    d = config.data
    problems = []
    if d.resolution % 64:
        problems.append(Problem("data.resolution", "a multiple of 64", str(d.resolution),
                                f"try {max(64, round(d.resolution / 64) * 64)}"))
    if not d.datasets:
        problems.append(Problem("data.datasets", "at least one dataset folder", "[]"))
    for i, ds in enumerate(d.datasets):
        if not ds.path.strip():
            problems.append(Problem(f"data.datasets[{i}].path",
                                    f"a folder of images or {BUILTIN_SHAPES}", repr(ds.path)))
    problems += _check_resolution_list("data.resolutions", d.resolutions)
    if d.resolutions and d.resolution not in d.resolutions:
        problems.append(Problem("data.resolution", "one of data.resolutions "
                                f"({', '.join(map(str, d.resolutions))})", str(d.resolution),
                                "samples and validation use data.resolution: set it to one of "
                                "the listed resolutions, or add it to data.resolutions"))
    for i, ds in enumerate(d.datasets):
        problems += _check_resolution_list(f"data.datasets[{i}].resolutions", ds.resolutions)
    largest = max([d.resolution, *d.resolutions])  # buckets must be possible somewhere
    if d.aspect_buckets and largest >= 64 and largest % 64 == 0 \
            and d.bucket_max_aspect >= 1.0:  # out-of-range values are the loader's to report
        problems += _check_buckets(largest, d.bucket_max_aspect)
    if d.cache_latents and not d.center_crop:
        problems.append(Problem("data.center_crop", "true when data.cache_latents is on", "false",
                                "a random crop would be frozen into the cached latents"))
    if d.cache_text_encoder_outputs and any(
            getattr(config.components, n).train for n in ("text_encoder", "text_encoder_2")):
        problems.append(Problem("data.cache_text_encoder_outputs",
                                "false while a text encoder is trained", "true",
                                "a trained encoder's outputs change every step"))
    if not d.caption_extension.startswith(".") or len(d.caption_extension) < 2:
        problems.append(Problem("data.caption_extension", "an extension such as '.txt'",
                                repr(d.caption_extension)))
    return problems


def _check_regularization(config: Config) -> list[Problem]:
    """Regularisation folders need a training folder beside them, and a prior loss weight
    without any regularisation folder would be silently unused."""
    datasets = config.data.datasets
    if datasets and all(ds.regularization for ds in datasets):
        return [Problem("data.datasets", "at least one dataset with regularization = false",
                        "only regularisation folders",
                        "class images alone train nothing: add the subject's folder")]
    if config.training.prior_loss_weight != 1.0 and not any(ds.regularization
                                                            for ds in datasets):
        return [Problem("training.prior_loss_weight", "1.0 while no dataset has "
                        "regularization = true", f"{config.training.prior_loss_weight:g}",
                        "mark the class-images folder as regularisation images, or leave the "
                        "weight at 1.0")]
    return []


def _check_resolution_list(path: str, values: list[int]) -> list[Problem]:
    """Each listed resolution a multiple of 64 within data.resolution's range, none twice;
    every bad value is its own problem, named by its index."""
    problems = []
    lo, hi = RESOLUTION_RANGE
    for i, value in enumerate(values):
        where = f"{path}[{i}]"
        if not lo <= value <= hi:
            problems.append(Problem(where, f"a side length between {lo} and {hi} pixels",
                                    str(value), f"try {min(max(lo, value), hi) // 64 * 64}"))
        elif value % 64:
            problems.append(Problem(where, "a multiple of 64", str(value),
                                    f"try {max(64, round(value / 64) * 64)}"))
        if value in values[:i]:
            problems.append(Problem(where, "a resolution not listed before", str(value),
                                    f"remove it: {value} is already {path}"
                                    f"[{values.index(value)}]"))
    return problems


def _check_buckets(resolution: int, max_aspect: float) -> list[Problem]:
    """Bucketing that can only produce the square bucket is a mistake the user should hear of."""
    if len(bucket_sizes(resolution, max_aspect)) > 1:
        return []
    narrowest = narrowest_non_square(resolution)
    if narrowest is None or narrowest > BUCKET_MAX_ASPECT_LIMIT:
        hint = (f"at resolution {resolution} only the square bucket has sides that are "
                "multiples of 64; use a larger resolution (192 allows 2:3 buckets)")
    else:
        enough = math.ceil(narrowest * 100) / 100
        hint = (f"at resolution {resolution} the least elongated non-square bucket has aspect "
                f"{narrowest:.2f}; raise data.bucket_max_aspect to {enough} or the resolution")
    return [Problem("data.aspect_buckets", "a resolution and data.bucket_max_aspect that allow "
                    "more than the square bucket (or aspect_buckets = false)", "true", hint)]


def _check_output_and_sampling(config: Config) -> list[Problem]:
    problems = []
    if not config.output.formats:
        problems.append(Problem("output.formats", "at least one format", "[]"))
    supported = SUPPORTED_FORMATS[config.training.method]
    for i, fmt in enumerate(config.output.formats):
        if fmt not in supported:
            problems.append(Problem(f"output.formats[{i}]",
                                    " or ".join(sorted(f.value for f in supported)), fmt.value,
                                    f"{fmt.value} does not apply to {config.training.method.value}"))
    if not config.output.dir.strip():
        problems.append(Problem("output.dir", "a folder path", repr(config.output.dir)))
    if not config.model.path.strip():
        problems.append(Problem("model.path", "a diffusers model folder, a .safetensors "
                                "checkpoint or a builtin: model", repr(config.model.path),
                                "choose the base model to train"))
    if (config.sampling.every_steps and not config.sampling.prompts
            and not config.sampling.prompts_file):
        problems.append(Problem("sampling.prompts", "at least one prompt when sampling is on",
                                "[]"))
    return problems + sample_prompts(config, read_file=False)[1]


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()
