"""The optimizers, as a table: what builds each, what it needs, and what it logs.

Data only (class names as strings, nothing imported): validation reads it to refuse a
missing package or device, and modules/train/recipe/builders.py builds the optimizer from it.

Each row names a well-kept implementation instead of Tempera's own maths: torch's AdamW,
bitsandbytes' 8-bit AdamW (CUDA), and pytorch-optimizer's Prodigy, Adafactor, Lion,
schedule-free AdamW and CAME (one package that keeps these close to their papers, tested,
with state dicts that round-trip; docs/optimizers.md says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from modules.config.schema import Optimizer


@dataclass(frozen=True)
class OptimizerRow:
    label: str
    module: str                   # where the class lives (imported when the run builds it)
    cls: str
    options: dict = field(default_factory=dict)  # constructor arguments besides lr, decay
    package: str = ""             # pip name, when it is not torch
    needs_cuda: bool = False
    schedule_free: bool = False   # averages weights itself: eval()/train() around sampling
    own_step_size: bool = False   # ignores the learning rate (Adafactor's relative step)
    # The optimizer's state per trained weight, one entry per tensor it keeps (STATE_KINDS);
    # modules/train/memory/memory_plan.py turns this into bytes (memory plan, backup size).
    state: tuple[str, ...] = ("copy", "copy")
    logs: tuple[str, ...] = ()    # param_group entries worth logging (Prodigy's d)
    lr_range: tuple[float, float] | None = None  # where training.learning_rate must lie
    # Why it cannot step FSDP's sharded weights ("" where it can: its step is elementwise, so a
    # shard steps as the whole weight would, and its state shards the same way; tested).
    under_fsdp: str = "it has not been tested on FSDP's sharded weights yet"


# What each entry of `OptimizerRow.state` is, for one trained weight of shape S:
STATE_KINDS = {
    "copy": "a tensor like the weight (its shape and dtype)",
    "bf16_copy": "a bfloat16 tensor of the weight's shape (pytorch-optimizer's Adafactor "
                 "momentum)",
    "factored": "for a weight of 2 or more dimensions, a row and a column vector (S[:-1] and "
                "S[:-2] + S[-1:]) in the weight's dtype; a 1-D weight gets a full copy",
    "factored_only": "the same row and column vectors; nothing for a 1-D weight",
    "8bit": "bitsandbytes' blockwise 8-bit state: 1 byte per element plus a float32 scale "
            "per 256 elements; float32 (4 bytes per element) under 4,096 elements",
}

PYTORCH_OPTIMIZER = "pytorch_optimizer"
_FACTORED_UNDER_FSDP = ("its factored second moment averages whole rows and columns of a "
                        "weight, and a process holds only a slice of its rows")
OPTIMIZERS: dict[Optimizer, OptimizerRow] = {
    Optimizer.ADAMW: OptimizerRow("AdamW", "torch.optim", "AdamW", under_fsdp=""),
    Optimizer.ADAMW_8BIT: OptimizerRow("AdamW 8-bit", "bitsandbytes.optim", "AdamW8bit",
                                       package="bitsandbytes", needs_cuda=True,
                                       state=("8bit", "8bit"),
                                       under_fsdp="bitsandbytes quantizes its state in blocks "
                                                  "of whole tensors, not of FSDP's shards"),
    Optimizer.PRODIGY: OptimizerRow("Prodigy", PYTORCH_OPTIMIZER, "Prodigy",
                                    package="pytorch-optimizer", state=("copy",) * 4,
                                    logs=("d",), lr_range=(0.1, 10.0),
                                    under_fsdp="its step size sums over every weight, which "
                                               "each process would sum over its shard alone"),
    Optimizer.ADAFACTOR: OptimizerRow(
        "Adafactor (fixed learning rate)", PYTORCH_OPTIMIZER, "AdaFactor",
        {"relative_step": False, "scale_parameter": False, "warmup_init": False},
        package="pytorch-optimizer", state=("bf16_copy", "factored"), under_fsdp=_FACTORED_UNDER_FSDP),
    Optimizer.ADAFACTOR_RELATIVE: OptimizerRow(
        "Adafactor (relative step)", PYTORCH_OPTIMIZER, "AdaFactor",
        {"relative_step": True, "scale_parameter": True, "warmup_init": False},
        package="pytorch-optimizer", own_step_size=True, state=("bf16_copy", "factored"),
        under_fsdp=_FACTORED_UNDER_FSDP),
    Optimizer.LION: OptimizerRow("Lion", PYTORCH_OPTIMIZER, "Lion",
                                 package="pytorch-optimizer", state=("copy",)),
    Optimizer.SCHEDULE_FREE_ADAMW: OptimizerRow(
        "Schedule-free AdamW", PYTORCH_OPTIMIZER, "ScheduleFreeAdamW",
        package="pytorch-optimizer", schedule_free=True),
    Optimizer.CAME: OptimizerRow("CAME", PYTORCH_OPTIMIZER, "CAME",
                                 package="pytorch-optimizer",
                                 state=("copy", "factored", "factored_only"),
                                 under_fsdp=_FACTORED_UNDER_FSDP),
}
