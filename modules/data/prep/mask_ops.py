"""From a segmenter's probabilities to the loss mask Tempera trains with: resize to the image,
threshold, grow or shrink, soften the edge, invert (in that order).

    shaped = shape_mask(probabilities, (width, height), MaskShape(threshold=0.4, dilate=8))

- `threshold`: a pixel whose probability is at least this counts fully (white), the others not
  at all (black); None keeps the probabilities as grey levels (a soft mask).
- `dilate`: pixels to grow the kept region by (a negative number shrinks it), with a
  near-round (octagonal) brush, so a subject's edge and a little of its surroundings train.
- `blur`: the radius in pixels of a Gaussian blur of the result, for a soft edge.
- `invert`: keep what the segmenter found *out* of the loss (a prompt for a watermark or a
  background keeps everything but it). Applied last, so `dilate` grows what was found.

Pure functions on arrays (torch for the morphology, Pillow for the blur); no model here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter


@dataclass(frozen=True)
class MaskShape:
    """How a segmenter's probabilities become a mask (see the module docstring)."""
    threshold: float | None = 0.5
    dilate: int = 0
    blur: float = 0.0
    invert: bool = False

    def problems(self) -> list[str]:
        """What is wrong with these options, one sentence each (empty when they are fine)."""
        out = []
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            out.append(f"threshold: expected a number from 0 to 1, got {self.threshold}")
        if abs(self.dilate) > 512:
            out.append(f"dilate: expected at most 512 pixels either way, got {self.dilate}")
        if not 0.0 <= self.blur <= 256.0:
            out.append(f"blur: expected a radius from 0 to 256 pixels, got {self.blur}")
        return out


def shape_mask(probabilities: np.ndarray, size: tuple[int, int], shape: MaskShape
               ) -> Image.Image:
    """A segmenter's (H, W) probabilities in [0, 1] as an 8-bit greyscale mask of `size`
    (width, height), shaped by `shape`."""
    values = torch.from_numpy(np.ascontiguousarray(probabilities, dtype=np.float32))
    # A model whose output is flat everywhere can give NaN (rembg divides by max - min).
    values = torch.nan_to_num(values, nan=0.0).clamp(0.0, 1.0)[None, None]
    width, height = size
    if tuple(values.shape[-2:]) != (height, width):
        values = F.interpolate(values, size=(height, width), mode="bilinear",
                               align_corners=False).clamp(0.0, 1.0)
    if shape.threshold is not None:
        values = (values >= shape.threshold).float()
    if shape.dilate:
        values = grow(values, shape.dilate)
    mask = Image.fromarray((values[0, 0].numpy() * 255.0 + 0.5).astype(np.uint8), mode="L")
    if shape.blur > 0:
        mask = mask.filter(ImageFilter.GaussianBlur(shape.blur))
    if shape.invert:
        mask = Image.eval(mask, lambda v: 255 - v)
    return mask


def grow(values: torch.Tensor, pixels: int) -> torch.Tensor:
    """(1, 1, H, W) values grown by `pixels` (a greyscale dilation; negative: an erosion).

    Alternating a 3x3 square and a 3x3 cross gives an octagon, the usual cheap stand-in for a
    round brush: `pixels` small steps instead of one (2r+1)^2 window per pixel."""
    if pixels < 0:
        return -grow(-values, -pixels)
    for step in range(pixels):
        if step % 2 == 0:
            values = F.max_pool2d(values, 3, stride=1, padding=1)
        else:
            across = F.max_pool2d(values, (1, 3), stride=1, padding=(0, 1))
            down = F.max_pool2d(values, (3, 1), stride=1, padding=(1, 0))
            values = torch.maximum(across, down)
    return values
