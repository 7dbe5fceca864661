"""Which latent dimensions may vary between batches (aspect-ratio buckets, last short batch).

With ``compile.dynamic = DYNAMIC`` every size is symbolic from the first compile
(``dynamic=True``), so nothing needs marking. With AUTO torch compiles the first shapes static
and recompiles once, dynamically, when a size changes; `mark_latents_dynamic` skips that
recompile for the UNet's input in FULL scope by marking batch, height and width up front.
In REGIONAL scope the blocks see intermediate tensors that carry no marks, so AUTO costs one
recompile per block class at the first new resolution (measured in tests/compile).
STATIC never marks: one compile per shape is what STATIC asks for.
"""
from __future__ import annotations

import torch

from modules.config.schema import DynamicShapes

LATENT_DYNAMIC_DIMS = (0, 2, 3)  # batch, height, width of (B, C, H, W) latents


def mark_latents_dynamic(latents: torch.Tensor, dynamic: DynamicShapes) -> torch.Tensor:
    """Mark ``latents``' batch/height/width dynamic under AUTO; returns the same tensor."""
    if dynamic == DynamicShapes.AUTO:
        # maybe_mark_dynamic, not mark_dynamic: a size dynamo must specialise (e.g. 1) then
        # just compiles static instead of raising ConstraintViolationError mid-run.
        torch._dynamo.maybe_mark_dynamic(latents, LATENT_DYNAMIC_DIMS)
    return latents
