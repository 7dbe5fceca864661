"""What the window shows for each config enum value, as a table.

Presets, the CLI and the docs use the values themselves (`AOT_EAGER`); the option menus show
these labels and map them back. A new enum member without a label here fails
tests/app/test_labels.py, so the window never shows a raw name by accident.
"""
from __future__ import annotations

from enum import Enum

from modules.config.schema import (Adapter, CompileBackend, CompileMode, CompileScope, Device,
                                   DistributedStrategy,
                                   DType, DynamicShapes, HuberSchedule, LossType, LRScheduler,
                                   MixedPrecision, Optimizer, PredictionType, Sampler,
                                   SaveDType, SaveFormat, TimestepSampling, TrainingMethod,
                                   WeightStorage)
from modules.config.optimizers import OPTIMIZERS
from modules.config.outputs import WandbMode
from modules.frontend import BACKENDS, MODEL_TYPES, ModelType

# By enum type first: members of str enums compare equal by value across types
# (Device.AUTO == DynamicShapes.AUTO), so one flat dict would mix them up.
ENUM_LABELS: dict[type[Enum], dict[Enum, str]] = {
    Device: {Device.AUTO: "Auto (GPU if any)", Device.CPU: "CPU", Device.CUDA: "NVIDIA GPU (CUDA)"},
    DType: {DType.FLOAT32: "float32", DType.FLOAT16: "float16", DType.BFLOAT16: "bfloat16"},
    PredictionType: {PredictionType.AUTO: "From the model", PredictionType.EPSILON: "Noise (epsilon)",
                     PredictionType.V_PREDICTION: "v-prediction"},
    TrainingMethod: {TrainingMethod.LORA: "LoRA", TrainingMethod.FINE_TUNE: "Full fine-tune",
                     TrainingMethod.TEXTUAL_INVERSION: "Textual inversion (embedding)"},
    Optimizer: {optimizer: row.label for optimizer, row in OPTIMIZERS.items()},
    Adapter: {Adapter.LORA: "LoRA", Adapter.LOCON: "LoCon (LoRA + convolutions)",
              Adapter.LOHA: "LoHa", Adapter.LOKR: "LoKr", Adapter.DORA: "DoRA"},
    LRScheduler: {LRScheduler.CONSTANT: "Constant", LRScheduler.COSINE: "Cosine",
                  LRScheduler.LINEAR: "Linear",
                  LRScheduler.COSINE_WITH_RESTARTS: "Cosine with restarts",
                  LRScheduler.POLYNOMIAL: "Polynomial", LRScheduler.INVERSE_SQRT: "Inverse sqrt"},
    Sampler: {Sampler.DDIM: "DDIM", Sampler.EULER: "Euler", Sampler.EULER_A: "Euler a",
              Sampler.DPMPP_2M_KARRAS: "DPM++ 2M Karras", Sampler.UNIPC: "UniPC"},
    MixedPrecision: {MixedPrecision.NO: "Off (float32)", MixedPrecision.FP16: "fp16",
                     MixedPrecision.BF16: "bf16"},
    CompileBackend: {member: row.label for member, row in BACKENDS.items()},
    CompileScope: {CompileScope.FULL: "Whole model", CompileScope.REGIONAL: "Repeated blocks",
                   CompileScope.AUTO: "Measured (fastest)"},
    CompileMode: {CompileMode.DEFAULT: "Default", CompileMode.REDUCE_OVERHEAD: "Reduce overhead",
                  CompileMode.MAX_AUTOTUNE: "Max autotune",
                  CompileMode.MAX_AUTOTUNE_NO_CUDAGRAPHS: "Max autotune, no graphs"},
    DynamicShapes: {DynamicShapes.DYNAMIC: "Dynamic", DynamicShapes.AUTO: "Automatic",
                    DynamicShapes.STATIC: "Static"},
    SaveFormat: {SaveFormat.DIFFUSERS: "Diffusers", SaveFormat.KOHYA: "Kohya LoRA",
                 SaveFormat.SINGLE_FILE: "Single file"},
    SaveDType: {SaveDType.AS_TRAINED: "As trained", SaveDType.FLOAT32: "float32",
                SaveDType.FLOAT16: "float16", SaveDType.BFLOAT16: "bfloat16"},
    ModelType: {member: spec.label for member, spec in MODEL_TYPES.items()},
    LossType: {LossType.MSE: "MSE (squared error)", LossType.HUBER: "Huber",
               LossType.SMOOTH_L1: "Smooth L1"},
    HuberSchedule: {HuberSchedule.CONSTANT: "Constant", HuberSchedule.EXPONENTIAL: "Exponential",
                    HuberSchedule.SNR: "By SNR"},
    TimestepSampling: {TimestepSampling.UNIFORM: "Uniform",
                       TimestepSampling.LOGIT_NORMAL: "Logit-normal"},
    DistributedStrategy: {DistributedStrategy.DDP: "DDP (each process holds the whole model)",
                          DistributedStrategy.FSDP: "FSDP (weights sharded over processes)"},
    WandbMode: {WandbMode.ONLINE: "Online (needs an API key)",
                WandbMode.OFFLINE: "Offline (sync later with wandb sync)"},
    WeightStorage: {WeightStorage.WEIGHT_DTYPE: "As the weight dtype",
                    WeightStorage.FLOAT8: "float8 (linear layers)",
                    WeightStorage.INT8: "int8 (linear layers)",
                    WeightStorage.W8A8: "int8 matmuls, W8A8 (denoiser linear layers)"},
}


def enum_label(member: Enum) -> str:
    """The label the window shows for `member` (its value when the table has none)."""
    return ENUM_LABELS.get(type(member), {}).get(member, str(member.value))


def enum_member(enum_type: type[Enum], text: str) -> Enum:
    """The member a label or a value names (either, case-insensitively); ValueError otherwise."""
    wanted = text.strip().lower()
    for member in enum_type:
        if wanted in (enum_label(member).lower(), str(member.value).lower()):
            return member
    raise ValueError(f"{text!r} is not one of " + ", ".join(enum_label(m) for m in enum_type))
