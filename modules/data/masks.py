"""Loss masks (data.masked_loss): which pixels of a training image count in the loss.

A mask is a greyscale PNG beside its image, named `<image stem>_mask.png` (`cat.jpg` +
`cat_mask.png`, modules/data/file_kinds.py): white counts, black is left out, grey counts partly. Without one, an image
with an alpha channel uses it (opaque counts). An image with neither trains on the whole
image. Mask files are never trained on as images, whether masked loss is on or not.

The mask goes through the image's own resize, crop and flip, so it always covers the same
pixels; the loss then averages it down to the latent size (`latent_mask`, an area average,
as kohya's sd-scripts does).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from modules.data.errors import DatasetError
from modules.data.images import (PreparedImage, Rng, TargetSize, coin_flip, open_rgb,
                                 plan_crop, prepare_image, resized_size, target_hw)

def check_mask(mask: Path, image_size: tuple[int, int] | None) -> str | None:
    """Why `mask` cannot be the mask of an image of (height, width) `image_size`, or None."""
    try:
        with Image.open(mask) as opened:
            opened.load()
            oriented = ImageOps.exif_transpose(opened)
            size = (oriented.height, oriented.width)
    except Exception as exc:  # noqa: BLE001 - returned as the reason, the caller raises it
        return f"{mask}: unreadable ({type(exc).__name__}: {exc})"
    if image_size is not None and size != tuple(image_size):
        return (f"{mask}: {size[1]}x{size[0]} pixels, but its image is "
                f"{image_size[1]}x{image_size[0]}; a mask must have its image's size")
    return None


def open_mask(mask: Path | None, image_path: Path, alpha: bool) -> Image.Image | None:
    """The mask of an image as an 8-bit greyscale PIL image (EXIF rotation applied): its mask
    file, else its alpha channel when `alpha`, else None (the whole image counts)."""
    source = mask if mask is not None else image_path if alpha else None
    if source is None:
        return None
    try:
        with Image.open(source) as opened:
            opened.load()
            oriented = ImageOps.exif_transpose(opened)
        if mask is not None:
            return oriented.convert("L")
        return oriented.convert("RGBA").getchannel("A")
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise DatasetError(f"cannot load the mask {source}: {type(exc).__name__}: {exc}") \
            from exc


def mask_is_blank(mask: Path | None, image_path: Path, alpha: bool) -> bool:
    """Whether an image's mask (its file, else its alpha channel) keeps no pixel at all: all
    black, or fully transparent. Such an image's loss is exactly 0 and it trains nothing."""
    opened = open_mask(mask, image_path, alpha)
    return opened is not None and opened.getextrema()[1] == 0


def prepare_mask(mask: Image.Image | None, target: TargetSize, crop_top_left: tuple[int, int],
                 flip: bool) -> torch.Tensor:
    """A mask as float (1, H, W) in [0, 1], resized, cropped and flipped exactly as its image
    (`crop_top_left` in the unflipped resized image, as `plan_crop` gives it); all ones when
    there is no mask."""
    target_h, target_w = target_hw(target)
    if mask is None:
        return torch.ones(1, target_h, target_w)
    height, width = resized_size(mask.height, mask.width, target)
    if (width, height) != mask.size:
        mask = mask.resize((width, height), Image.Resampling.BILINEAR, reducing_gap=3.0)
    top, left = crop_top_left
    mask = mask.crop((left, top, left + target_w, top + target_h))
    if flip:
        mask = ImageOps.mirror(mask)
    values = np.array(mask, dtype=np.uint8)
    return torch.from_numpy(values).float().div(255.0).unsqueeze(0)


def load_masked_sample(path: Path, mask: Path | None, alpha: bool, target: TargetSize,
                       center_crop: bool, random_flip: bool, rng: Rng | None
                       ) -> tuple[PreparedImage, torch.Tensor]:
    """`load_training_image` with the image's mask: the same draws in the same order (crop,
    then flip), so the pixels are those of an unmasked run and the mask covers them."""
    if rng is None and (random_flip or not center_crop):
        raise ValueError("a random crop or flip needs an rng (random.Random or torch.Generator)")
    image = open_rgb(path)
    crop = plan_crop((image.height, image.width), target, center_crop, rng)
    flip = random_flip and rng is not None and coin_flip(rng)  # flipping has an rng (above)
    mask_image = open_mask(mask, path, alpha)
    return (prepare_image(image, target, crop, flip),
            prepare_mask(mask_image, target, crop, flip))


def latent_mask(mask: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """A (B, 1, H, W) mask averaged down to `size` (height, width): each latent pixel gets the
    share of its image pixels that count."""
    if tuple(mask.shape[-2:]) == tuple(size):
        return mask
    return F.interpolate(mask.float(), size=tuple(size), mode="area")


def mask_source(mask: Path | None, alpha: bool) -> str:
    """What an image's mask comes from: "file", "alpha" or "none" (counted for the run)."""
    return "file" if mask is not None else "alpha" if alpha else "none"


