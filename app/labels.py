"""What the window shows for each config enum value, as a table.

Presets, the CLI and the docs use the values themselves (`AOT_EAGER`); the option menus show
these labels and map them back. A new enum member without a label here fails
tests/app/test_labels.py, so the window never shows a raw name by accident.
"""
from __future__ import annotations

from enum import Enum

from modules.config.schema import (CompileBackend, CompileMode, CompileScope, Device, DType,
                                   DynamicShapes, LRScheduler, MixedPrecision, Optimizer,
                                   PredictionType, SaveFormat, TrainingMethod)
from modules.model_types import MODEL_TYPES

ENUM_LABELS: dict[Enum, str] = {
    Device.AUTO: "Automatic (GPU when there is one)", Device.CPU: "CPU", Device.CUDA: "NVIDIA GPU (CUDA)",
    DType.FLOAT32: "float32 (full precision)", DType.FLOAT16: "float16", DType.BFLOAT16: "bfloat16",
    PredictionType.AUTO: "From the model", PredictionType.EPSILON: "Noise (epsilon)",
    PredictionType.V_PREDICTION: "Velocity (v-prediction)",
    TrainingMethod.LORA: "LoRA", TrainingMethod.FINE_TUNE: "Full fine-tune",
    Optimizer.ADAMW: "AdamW", Optimizer.ADAMW_8BIT: "AdamW 8-bit (bitsandbytes)",
    LRScheduler.CONSTANT: "Constant", LRScheduler.COSINE: "Cosine", LRScheduler.LINEAR: "Linear",
    MixedPrecision.NO: "Off (float32)", MixedPrecision.FP16: "float16 (fp16)",
    MixedPrecision.BF16: "bfloat16 (bf16)",
    CompileBackend.NONE: "None (eager)", CompileBackend.DEFAULT: "Default (torch's choice)",
    CompileBackend.INDUCTOR: "Inductor", CompileBackend.TRITON: "Triton (Inductor + CUDA graphs)",
    CompileBackend.AOT_EAGER: "AOT eager (debugging)",
    CompileScope.FULL: "Whole model", CompileScope.REGIONAL: "Repeated blocks (regional)",
    CompileMode.DEFAULT: "Default", CompileMode.REDUCE_OVERHEAD: "Reduce overhead (CUDA graphs)",
    CompileMode.MAX_AUTOTUNE: "Max autotune",
    CompileMode.MAX_AUTOTUNE_NO_CUDAGRAPHS: "Max autotune, no CUDA graphs",
    DynamicShapes.DYNAMIC: "Dynamic", DynamicShapes.AUTO: "Automatic (dynamic after a change)",
    DynamicShapes.STATIC: "Static (one graph per shape)",
    SaveFormat.DIFFUSERS: "Diffusers", SaveFormat.KOHYA: "Kohya LoRA (ComfyUI, A1111)",
    SaveFormat.SINGLE_FILE: "Single file (.safetensors)",
    **{member: spec.label for member, spec in MODEL_TYPES.items()},
}


def enum_label(member: Enum) -> str:
    """The label the window shows for `member` (its value when the table has none)."""
    return ENUM_LABELS.get(member, str(member.value))


def enum_member(enum_type: type[Enum], text: str) -> Enum:
    """The member a label or a value names (either, case-insensitively); ValueError otherwise."""
    wanted = text.strip().lower()
    for member in enum_type:
        if wanted in (enum_label(member).lower(), str(member.value).lower()):
            return member
    raise ValueError(f"{text!r} is not one of " + ", ".join(enum_label(m) for m in enum_type))
