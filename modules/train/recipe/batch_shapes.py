"""Which batch shapes a run trained on, and how often the compiled code recompiled for them.

With aspect-ratio buckets (and every bucket's short last batch) a run feeds the model several
shapes. Compiling once per shape during the first pass over the buckets is expected; a
recompile after every shape has been seen once means compiled code is being thrown away
during training, which is what `recompiles_after_first_pass` in run.json shows.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Shape = tuple[int, int, int]  # (batch, height, width) in pixels


@dataclass
class BatchShapeLog:
    """Distinct batch shapes in the order first trained, and the recompile count at the end of
    the micro-step that trained the last new one (the end of the first pass over the shapes)."""
    shapes: list[Shape] = field(default_factory=list)
    micro_steps: int = 0
    first_pass_micro_steps: int = 0
    recompiles_in_first_pass: int = 0
    # the run's recompiles so far at the end of each new shape's first micro-step
    recompiles_at_new_shapes: list[int] = field(default_factory=list)

    def add(self, shape: Shape, recompiles: Callable[[], int]) -> None:
        """Count one finished micro-step on `shape`; `recompiles()` is the run's total so far
        (read only when the shape is new)."""
        self.micro_steps += 1
        if shape not in self.shapes:
            self.shapes.append(shape)
            self.first_pass_micro_steps = self.micro_steps
            self.recompiles_in_first_pass = recompiles()
            self.recompiles_at_new_shapes.append(self.recompiles_in_first_pass)

    def report(self, recompiles: int) -> dict:
        """The run record's `batch_shapes` section, given the run's total recompiles."""
        return {
            "distinct": len(self.shapes),
            "shapes": [{"batch": b, "height": h, "width": w} for b, h, w in self.shapes],
            "micro_steps": self.micro_steps,
            "first_pass_micro_steps": self.first_pass_micro_steps,
            "recompiles": recompiles,
            "recompiles_in_first_pass": self.recompiles_in_first_pass,
            "recompiles_after_first_pass": recompiles - self.recompiles_in_first_pass,
            "recompiles_at_new_shapes": list(self.recompiles_at_new_shapes),
            "new_shapes_that_recompiled": sum(
                later > earlier for earlier, later in zip(self.recompiles_at_new_shapes,
                                                          self.recompiles_at_new_shapes[1:])),
        }
