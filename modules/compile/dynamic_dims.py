"""Which latent dimensions may vary between batches (aspect-ratio buckets, last short batch).

With ``compile.dynamic = DYNAMIC`` every size is symbolic from the first compile
(``dynamic=True``), so nothing needs marking. With AUTO torch compiles the first shapes static
and recompiles once, dynamically, when a size changes; `input_dims` says which dimensions of a
compiled component's input to mark up front so that recompile is skipped (batch, height and
width), and which to keep static where the compiler cannot take them symbolic (a whole UNet or
VAE under inductor: one compile per bucket size instead, see plan.SPATIAL_DYNAMIC_LIMITS).
In REGIONAL scope the blocks see intermediate tensors that carry no marks, so AUTO costs one
recompile per block class at the first new resolution (measured in tests/compile).
STATIC never marks: one compile per shape is what STATIC asks for.
"""
from __future__ import annotations

import torch

from modules.compile.plan import CompilePlan
from modules.config.schema import DynamicShapes

BATCH_DIM = 0
SPATIAL_DIMS = (2, 3)  # height, width of (B, C, H, W) latents or pixels
LATENT_DYNAMIC_DIMS = (BATCH_DIM, *SPATIAL_DIMS)


def input_dims(plan: CompilePlan, dynamic: DynamicShapes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dimensions to mark dynamic, dimensions to mark static) for a component's input."""
    if not plan.compiled or dynamic == DynamicShapes.STATIC:
        return (), ()
    if plan.static_spatial:
        return (BATCH_DIM,), SPATIAL_DIMS
    if dynamic == DynamicShapes.AUTO:
        return LATENT_DYNAMIC_DIMS, ()
    return (), ()  # DYNAMIC: symbolic already


def mark_input(tensor: torch.Tensor, dynamic_dims: tuple[int, ...],
               static_dims: tuple[int, ...]) -> torch.Tensor:
    """Mark ``tensor``'s dimensions for dynamo; returns the same tensor."""
    if dynamic_dims:
        # maybe_mark_dynamic, not mark_dynamic: a size dynamo must specialise (e.g. 1) then
        # just compiles static instead of raising ConstraintViolationError mid-run.
        torch._dynamo.maybe_mark_dynamic(tensor, dynamic_dims)
    for dim in static_dims:
        torch._dynamo.mark_static(tensor, dim)
    return tensor
