"""Loading one training image: check it, fix orientation and colour mode, resize, crop, flip.

Every function here works on one image and takes its randomness as an argument (a seeded
`random.Random` or `torch.Generator`), so the dataset can make each item depend only on
(seed, epoch, index) and dataloader workers agree with the main process.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps

from modules.data.errors import DatasetError
from modules.data.file_kinds import IMAGE_EXTENSIONS


Rng = random.Random | torch.Generator
# What an image is cropped to: a square side (`data.resolution`) or an aspect-ratio bucket's
# (height, width).
TargetSize = int | tuple[int, int]

# Side of the reduced decode used by `check_image`: JPEG decodes at 1/2..1/8 scale (`draft`),
# which still reads every byte of the file, so truncation is caught without a full decode.
_CHECK_SIZE = 64
# EXIF orientations 5-8 are rotations by 90 degrees: the stored width and height swap.
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
_WHITE = (255, 255, 255, 255)


@dataclass(frozen=True)
class PreparedImage:
    """One image ready for training.

    `pixels` is float32 CHW in [-1, 1]. `original_size` is (height, width) after EXIF rotation
    and before resizing. `crop_top_left` is (top, left) in the resized image as the model sees
    it, i.e. mirrored when `flipped` (the convention of diffusers' SDXL training script, used
    for SDXL's crop conditioning).
    """
    pixels: torch.Tensor
    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    flipped: bool


def is_image_file(path: Path) -> bool:
    """True for a file whose extension is one Tempera trains on (case-insensitive)."""
    return path.suffix.lower() in IMAGE_EXTENSIONS


@dataclass(frozen=True)
class ImageCheck:
    """What the scan learns about one file: its (height, width) after EXIF rotation when it
    loads, or why it cannot be trained on; and whether it has transparency (an alpha channel
    is the image's mask under data.masked_loss)."""
    size: tuple[int, int] | None
    reason: str | None
    alpha: bool = False


def check_image(path: Path) -> str | None:
    """Why `path` cannot be trained on, or None when it loads (see `inspect_image`)."""
    return inspect_image(path).reason


def inspect_image(path: Path) -> ImageCheck:
    """Check that `path` loads and read its oriented size, without a full-size decode.

    Runs PIL's `verify` (catches most broken PNGs) and then a real, reduced decode plus the
    same orientation and colour conversion training uses (catches truncated JPEGs and
    unconvertible modes, which `verify` lets through). Called once per file at scan time so a
    bad file is skipped with a reason instead of crashing the run later; the size it reads on
    the way is what aspect-ratio bucketing needs, so no second pass over the files is made.
    """
    try:
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            width, height = image.size  # the header's size; `draft` below may shrink it
            image.draft("RGB", (_CHECK_SIZE, _CHECK_SIZE))  # JPEG only; other formats ignore it
            image.load()
            orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
            alpha = image.has_transparency_data
            to_rgb(ImageOps.exif_transpose(image))
    # PIL reports a bad file through many exception types (OSError, SyntaxError, ValueError,
    # struct.error, EOFError, DecompressionBombError...); each becomes a reported skip reason.
    except Exception as exc:  # noqa: BLE001 - converted to a reason, never swallowed
        return ImageCheck(None, f"{type(exc).__name__}: {exc}")
    return ImageCheck(_displayed_hw(width, height, orientation), None, alpha)


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB.

    Transparency (RGBA, LA, PA, P or L with a transparent colour) is composited on white,
    because a black background under transparent pixels teaches the model black halos.
    16-bit greyscale is scaled down (plain `convert` would clip everything above 255 to white).
    CMYK uses PIL's conversion, which ignores ICC profiles.
    """
    if image.mode == "RGB":
        return image
    if image.mode in _SIXTEEN_BIT_MODES:
        return _sixteen_bit_to_rgb(image)
    if image.has_transparency_data:
        background = Image.new("RGBA", image.size, _WHITE)
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def _sixteen_bit_to_rgb(image: Image.Image) -> Image.Image:
    """Scale 16-bit greyscale (0..65535) to 8-bit RGB.

    Mode "I" (32-bit int) is what PIL gives for some 16-bit PNGs, so it is read as 16-bit too.
    """
    values = np.asarray(image, dtype=np.float64) / 257.0
    grey = np.clip(np.rint(values), 0, 255).astype(np.uint8)
    return Image.fromarray(grey).convert("RGB")


def open_rgb(path: Path) -> Image.Image:
    """Decode `path` fully, apply its EXIF orientation and convert it to RGB.

    Raises DatasetError naming the file when it cannot be decoded (e.g. it changed after the
    scan).
    """
    try:
        with Image.open(path) as image:
            image.load()
            oriented = ImageOps.exif_transpose(image)
        return to_rgb(oriented)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise DatasetError(f"cannot load image {path}: {type(exc).__name__}: {exc}") from exc


def oriented_size(path: Path) -> tuple[int, int]:
    """(height, width) of `path` after EXIF rotation, read from the header.

    JPEG and WebP keep EXIF in the header; PIL loads a PNG's pixels to find an EXIF chunk, so
    prefer the size the scan already read (`ScanItem.size`).
    """
    try:
        with Image.open(path) as image:
            width, height = image.size
            orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file named
        raise DatasetError(f"cannot read image {path}: {type(exc).__name__}: {exc}") from exc
    return _displayed_hw(width, height, orientation)


def _displayed_hw(width: int, height: int, orientation: int) -> tuple[int, int]:
    """(height, width) as shown after EXIF rotation, from the stored width, height and tag."""
    if orientation in _SWAPPING_ORIENTATIONS:
        return width, height
    return height, width


def target_hw(target: TargetSize) -> tuple[int, int]:
    """(height, width) of a target: a square side, or an aspect-ratio bucket's size."""
    if isinstance(target, int):
        return target, target
    height, width = target
    return int(height), int(width)


def resized_size(height: int, width: int, target: TargetSize) -> tuple[int, int]:
    """(height, width) after scaling, aspect kept, so the image just covers `target`.

    For a square target that is "short side = resolution"; for a bucket, the side that is
    short relative to the bucket's shape matches and the other overhangs (cropped later).
    """
    target_h, target_w = target_hw(target)
    scale = max(target_h / height, target_w / width)
    return max(target_h, round(height * scale)), max(target_w, round(width * scale))


def random_int(rng: Rng, high: int) -> int:
    """A uniform integer in [0, high] from `rng` (never the global RNG)."""
    if isinstance(rng, torch.Generator):
        return int(torch.randint(0, high + 1, (1,), generator=rng).item())
    return rng.randint(0, high)


def coin_flip(rng: Rng) -> bool:
    """True with probability 1/2, drawn from `rng`."""
    if isinstance(rng, torch.Generator):
        return bool(torch.rand((), generator=rng).item() < 0.5)
    return rng.random() < 0.5


def plan_crop(original_size: tuple[int, int], target: TargetSize, center_crop: bool,
              rng: Rng | None) -> tuple[int, int]:
    """(top, left) of the `target`-sized crop in the resized, unflipped image.

    Depends only on the image size, so the latent cache can plan a crop from the header alone.
    A random crop needs `rng`.
    """
    target_h, target_w = target_hw(target)
    height, width = resized_size(*original_size, target)
    if center_crop:
        return (height - target_h) // 2, (width - target_w) // 2
    if rng is None:
        raise ValueError("a random crop needs an rng (random.Random or torch.Generator)")
    return random_int(rng, height - target_h), random_int(rng, width - target_w)


def prepare_image(image: Image.Image, target: TargetSize, crop_top_left: tuple[int, int],
                  flip: bool) -> PreparedImage:
    """Resize an RGB image to cover `target`, crop at `crop_top_left`, maybe mirror.

    `crop_top_left` is in the unflipped resized image (as `plan_crop` returns it); the result
    reports it in the flipped image when `flip` is set (see `PreparedImage`).
    """
    target_h, target_w = target_hw(target)
    original_size = (image.height, image.width)
    height, width = resized_size(*original_size, target)
    if (width, height) != image.size:
        # reducing_gap: reduce by an integer factor first, then LANCZOS; fast on big photos
        # with no visible difference at training resolutions.
        image = image.resize((width, height), Image.Resampling.LANCZOS, reducing_gap=3.0)
    top, left = crop_top_left
    if not (0 <= top <= height - target_h and 0 <= left <= width - target_w):
        raise ValueError(f"crop {crop_top_left} does not fit a {height}x{width} image "
                         f"for a {target_h}x{target_w} target")
    image = image.crop((left, top, left + target_w, top + target_h))
    if flip:
        image = ImageOps.mirror(image)
        left = width - target_w - left
    return PreparedImage(pixels=pil_to_tensor(image), original_size=original_size,
                         crop_top_left=(top, left), flipped=flip)


def load_training_image(path: Path, target: TargetSize, center_crop: bool, random_flip: bool,
                        rng: Rng | None = None) -> PreparedImage:
    """Load `path` as one training sample: orientation, RGB, resize, crop, optional flip.

    `target` is `data.resolution` (a square) or the (height, width) of the image's bucket.
    `rng` (seeded by the caller) draws the random crop first, then the flip; it may be None
    only when neither is random.
    """
    if rng is None and (random_flip or not center_crop):
        raise ValueError("a random crop or flip needs an rng (random.Random or torch.Generator)")
    image = open_rgb(path)
    crop = plan_crop((image.height, image.width), target, center_crop, rng)
    flip = random_flip and rng is not None and coin_flip(rng)  # flipping has an rng (above)
    return prepare_image(image, target, crop, flip)


def pil_to_tensor(image: Image.Image) -> torch.Tensor:
    """RGB PIL image -> float32 CHW tensor in [-1, 1] (the range the VAE expects)."""
    array = np.array(image, dtype=np.uint8)  # a writable copy, so from_numpy does not warn
    return torch.from_numpy(array).permute(2, 0, 1).float().div(127.5).sub(1.0)
