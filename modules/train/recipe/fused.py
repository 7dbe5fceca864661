"""The fused backward pass (`training.fused_backward`, full fine-tunes): each trained weight's
optimizer step runs as soon as backward has accumulated its gradient, and the gradient is freed
right after, so the full set of gradients never exists at once (torch's "optimizer step in
backward" pattern: one optimizer per weight, stepped from
`Tensor.register_post_accumulate_grad_hook`).

`FusedBackward` looks like one optimizer to the rest of the run: its parameter groups carry the
learning rates the LR schedule sets (each weight's own optimizer takes its group's rate before
it steps), its state dict holds every per-weight optimizer's state (backups resume exactly),
and `step()` closes the optimizer step the hooks already applied.

What it decides (docs/memory.md, "Fused backward"):
- `max_grad_norm` clips each weight's gradient on its own: no global norm exists before the
  first weight has stepped. The step's recorded gradient norm is still the global one (the
  square root of the sum of the per-weight squared norms, before clipping).
- a weight whose gradient is not finite keeps its value and its optimizer state (the others
  step); the loop then counts the step as non-finite, so `max_bad_steps` still stops a run
  that keeps producing them, and run.json counts the weights that were held back.
- bfloat16 weights step with stochastic rounding through torchao's AdamW
  (`bf16_stochastic_round=True`): the update is computed in float32 and rounded up or down
  at random in proportion to the distance, so updates smaller than bfloat16's spacing are
  not all lost.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from modules.config.optimizers import OPTIMIZERS
from modules.config.problems import ConfigError, Problem
from modules.config.schema import Config, DType, Optimizer

if TYPE_CHECKING:
    from modules.train.memory.offload_trained import HostSteps

# the per-weight optimizer for bfloat16 weights: torchao's plain AdamW (torch's AdamW has no
# stochastic rounding); `_AdamW` is the name torchao gives it beside torch's own AdamW
STOCHASTIC_ROUNDING = {Optimizer.ADAMW: ("torchao.optim", "_AdamW")}

PerWeight = Callable[[dict], torch.optim.Optimizer]


def stochastic_rounding(config: Config) -> bool:
    """The fused pass updates bfloat16 trained weights with stochastic rounding."""
    return config.training.fused_backward and config.model.train_dtype == DType.BFLOAT16


def per_weight_optimizer(config: Config) -> PerWeight:
    """What builds one weight's optimizer from its parameter group: the config's optimizer
    (modules/config/optimizers.py), or torchao's AdamW with stochastic rounding for bfloat16
    weights (validation refuses the optimizers that have no such path)."""
    t = config.training
    if stochastic_rounding(config):
        module, name = STOCHASTIC_ROUNDING[t.optimizer]
        cls = getattr(importlib.import_module(module), name)
        return lambda group: cls([group], weight_decay=t.weight_decay,
                                 bf16_stochastic_round=True)
    row = OPTIMIZERS[t.optimizer]
    cls = getattr(importlib.import_module(row.module), row.cls)
    return lambda group: cls([group], weight_decay=t.weight_decay, **row.options)


class FusedBackward(torch.optim.Optimizer):
    """One optimizer per trained weight, stepped by a hook as its gradient is accumulated."""

    def __init__(self, groups: list[dict], per_weight: PerWeight, max_grad_norm: float):
        super().__init__(groups, {})
        self.max_grad_norm = max_grad_norm
        self.weights: list[tuple[torch.optim.Optimizer, dict]] = []
        self.handles = []
        for group in self.param_groups:
            for param in group["params"]:
                inner = per_weight({"params": [param], "lr": group["lr"]})
                self.handles.append(param.register_post_accumulate_grad_hook(
                    self._hook(len(self.weights))))
                self.weights.append((inner, group))
        self.norms: list[torch.Tensor] = []  # this step's per-weight gradient norms
        self.held_back = 0                   # weights of this step with non-finite gradients
        # block offload of a full fine-tune: the weights that step on their host copies
        # (train/memory/offload_trained.py), set by the recipe once the streamer is built
        self.host_steps: HostSteps | None = None

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def step_weight(param: torch.Tensor) -> None:
            inner, group = self.weights[index]
            grad = param.grad
            assert grad is not None
            norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
            self.norms.append(norm)
            if not torch.isfinite(norm):  # a host sync per weight: the NaN guard's cost
                self.held_back += 1
            else:
                if self.max_grad_norm:
                    grad.mul_((self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
                              .to(grad.dtype))
                set_lr(inner, group["lr"])
                if self.host_steps is not None and self.host_steps.holds(param):
                    self.host_steps.step(param, inner)
                else:
                    inner.step()
            param.grad = None
        return step_weight

    def unfinished_step(self) -> str:
        """Why the weights are part way through a step ("" when they are not): some hooks of
        the step in flight have run, so a replay of it or a backup now would be wrong."""
        if not self.norms:
            return ""
        return (f"the fused backward pass had already updated {len(self.norms)} of "
                f"{len(self.weights)} weights of the step")

    def gradient_norm(self) -> torch.Tensor:
        """The step's global gradient norm (before the per-weight clipping), on the device."""
        if not self.norms:  # backward was skipped (a non-finite loss)
            return torch.zeros(())
        return torch.linalg.vector_norm(torch.stack(self.norms))

    @torch.no_grad()
    def step(self, closure=None) -> None:  # type: ignore[override]
        """Close the step: the hooks have stepped every weight already."""
        self.norms, self.held_back = [], 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: each hook freed its gradient."""

    def state_dict(self) -> dict:
        return {"param_groups": [{k: v for k, v in group.items() if k != "params"}
                                 for group in self.param_groups],
                "per_weight": [inner.state_dict() for inner, _ in self.weights]}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["per_weight"]
        if len(saved) != len(self.weights) or len(state_dict["param_groups"]) != len(
                self.param_groups):
            raise ValueError(f"the backup holds {len(saved)} per-weight optimizers, this run "
                             f"trains {len(self.weights)} weights")
        for group, kept in zip(self.param_groups, state_dict["param_groups"]):
            group.update(kept)
        for (inner, _), state in zip(self.weights, saved):
            inner.load_state_dict(state)

    def close(self) -> None:
        """Take the hooks off the weights (a later run in the same process adds its own)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The run's current rate into a per-weight optimizer: torchao keeps its rate as a tensor
    (changed in place, so its compiled step is not recompiled)."""
    group = optimizer.param_groups[0]
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


def fused_record(config: Config, world_size: int, persistent_grads: bool) -> dict | None:
    """run.json's `fused_backward` row, or None when the lever is off. Refuses what only the
    started run knows: several processes (DDP reduces gradients in buckets after backward;
    a weight stepped inside backward would step on its unreduced local gradient) and CUDA
    graphs on a trained component (they need gradients that stay allocated)."""
    if not config.training.fused_backward:
        return None
    problems = []
    if world_size > 1:
        problems.append(Problem(
            "training.fused_backward", "false with several processes", "true",
            f"{world_size} processes: DDP averages the gradients across processes after "
            "backward, but the fused pass steps each weight inside backward on its local "
            "gradient; train on one process, or set training.fused_backward=false"))
    if persistent_grads:
        problems.append(Problem(
            "training.fused_backward", "false with CUDA graphs on a trained component", "true",
            "CUDA graphs keep the gradients allocated between steps, which is what the fused "
            "pass frees; use compile.mode DEFAULT, or set training.fused_backward=false"))
    if problems:
        raise ConfigError(problems)
    return {"on": True, "stochastic_rounding": stochastic_rounding(config),
            "per_weight_optimizer": (".".join(STOCHASTIC_ROUNDING[config.training.optimizer])
                                     if stochastic_rounding(config)
                                     else config.training.optimizer.value),
            "gradient_clipping": ("per weight" if config.training.max_grad_norm else "off"),
            "weights_held_back": 0}
