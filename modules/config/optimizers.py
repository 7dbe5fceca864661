"""The optimizers, as a table: what builds each, what it needs, and what it logs.

Data only (class names as strings, nothing imported): validation reads it to refuse a
missing package or device, and modules/train/builders.py builds the optimizer from it.

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
    state_per_weight: float = 2   # optimizer state, in fp32 copies of each trained weight
    logs: tuple[str, ...] = ()    # param_group entries worth logging (Prodigy's d)
    lr_range: tuple[float, float] | None = None  # where training.learning_rate must lie


PYTORCH_OPTIMIZER = "pytorch_optimizer"
OPTIMIZERS: dict[Optimizer, OptimizerRow] = {
    Optimizer.ADAMW: OptimizerRow("AdamW", "torch.optim", "AdamW"),
    Optimizer.ADAMW_8BIT: OptimizerRow("AdamW 8-bit", "bitsandbytes.optim", "AdamW8bit",
                                       package="bitsandbytes", needs_cuda=True,
                                       state_per_weight=0.5),
    Optimizer.PRODIGY: OptimizerRow("Prodigy", PYTORCH_OPTIMIZER, "Prodigy",
                                    package="pytorch-optimizer", state_per_weight=4,
                                    logs=("d",), lr_range=(0.1, 10.0)),
    Optimizer.ADAFACTOR: OptimizerRow(
        "Adafactor (fixed learning rate)", PYTORCH_OPTIMIZER, "AdaFactor",
        {"relative_step": False, "scale_parameter": False, "warmup_init": False},
        package="pytorch-optimizer", state_per_weight=1),
    Optimizer.ADAFACTOR_RELATIVE: OptimizerRow(
        "Adafactor (relative step)", PYTORCH_OPTIMIZER, "AdaFactor",
        {"relative_step": True, "scale_parameter": True, "warmup_init": False},
        package="pytorch-optimizer", own_step_size=True, state_per_weight=1),
    Optimizer.LION: OptimizerRow("Lion", PYTORCH_OPTIMIZER, "Lion",
                                 package="pytorch-optimizer", state_per_weight=1),
    Optimizer.SCHEDULE_FREE_ADAMW: OptimizerRow(
        "Schedule-free AdamW", PYTORCH_OPTIMIZER, "ScheduleFreeAdamW",
        package="pytorch-optimizer", schedule_free=True),
    Optimizer.CAME: OptimizerRow("CAME", PYTORCH_OPTIMIZER, "CAME",
                                 package="pytorch-optimizer", state_per_weight=3),
}
