"""One dataset's preview for the GUI: a caption after its caption rules, and an image with
its loss mask drawn over it.

Torch-free (the GUI reads it before torch is imported): it lists the folder itself instead of
running the full scan, takes the first image in the order the scan sorts them, and reads its
caption the way the scan does (captions file, then the caption file beside it, then the
folder's class caption).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps

from modules.data.captions import (CaptionRules, CaptionsFileError, load_captions_file,
                                   transform_caption)
from modules.data.file_kinds import IMAGE_EXTENSIONS, split_masks
from modules.data.seeds import derive_seed

MASKED_OUT_TINT = (150, 20, 20)  # what a left-out pixel is blended with in the preview
TINT_SHARE = 0.6


@dataclass(frozen=True)
class DatasetPreview:
    """What the dataset box shows: the image, its caption as written and as trained (one
    draw of the shuffles and drops), and with masked loss an RGB picture of the image with
    the left-out part tinted and where its mask came from. `note` says why something is
    missing (no folder, no image)."""
    image: Path | None = None
    caption: str = ""
    trained: str = ""
    varies: bool = False
    overlay: Image.Image | None = None
    mask_source: str = ""
    note: str = ""


def dataset_rules(ds) -> CaptionRules:
    """A dataset config's caption rules (the same as a run's, modules/train/setup/start.py)."""
    return CaptionRules(ds.caption_prefix, ds.caption_suffix, ds.shuffle_tags, ds.keep_tags,
                        ds.tag_dropout)


def first_image(folder: Path, recursive: bool) -> tuple[Path | None, Path | None]:
    """The folder's first image in the scan's order (not a mask, not hidden), and its mask."""
    candidates = folder.rglob("*") if recursive else folder.iterdir()
    files = sorted((p for p in candidates if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(folder).parts)),
        key=lambda p: p.relative_to(folder).as_posix())
    images, masks = split_masks(files, [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS])
    if not images:
        return None, None
    return images[0], masks.get((images[0].parent, images[0].stem.lower()))


def image_caption(ds, folder: Path, image: Path, caption_extension: str) -> str:
    """The caption the scan gives `image`: captions file, caption file, class caption."""
    if ds.captions_file:
        listed = load_captions_file(Path(ds.captions_file))
        relative = image.relative_to(folder).as_posix()
        if relative in listed or image.name in listed:
            return listed.get(relative, listed.get(image.name, ""))
    extension = caption_extension if caption_extension.startswith(".") else "." + caption_extension
    beside = image.with_suffix(extension)
    if beside.is_file():
        return beside.read_text(encoding="utf-8-sig").strip()
    return ds.class_caption.strip()


def mask_overlay(image_path: Path, mask_path: Path | None, size: int) -> tuple[Image.Image, str]:
    """A `size`-pixel thumbnail of the image with its left-out part tinted, and the mask's
    source ("file", "alpha", "none")."""
    with Image.open(image_path) as opened:
        image = ImageOps.exif_transpose(opened)
        image.load()
    if mask_path is not None:
        with Image.open(mask_path) as opened:
            mask, source = ImageOps.exif_transpose(opened).convert("L"), "file"
    elif image.has_transparency_data:
        mask, source = image.convert("RGBA").getchannel("A"), "alpha"
    else:
        mask, source = Image.new("L", image.size, 255), "none"
    rgb = image.convert("RGBA")
    rgb = Image.alpha_composite(Image.new("RGBA", rgb.size, (255, 255, 255, 255)), rgb)
    rgb = rgb.convert("RGB")
    if mask.size != rgb.size:
        mask = mask.resize(rgb.size)
    tinted = Image.blend(rgb, Image.new("RGB", rgb.size, MASKED_OUT_TINT), TINT_SHARE)
    overlay = Image.composite(rgb, tinted, mask)
    overlay.thumbnail((size, size))
    return overlay, source


def preview_dataset(config, index: int, draw: int = 0, size: int = 128,
                    builtin_folder=None) -> DatasetPreview:
    """The preview of `config.data.datasets[index]`; `draw` picks another shuffle/drop of the
    caption ("shuffle again"). `builtin_folder(path)` gives a built-in dataset's folder."""
    ds = config.data.datasets[index]
    folder = builtin_folder(ds.path) if builtin_folder and ds.path.startswith("builtin:") \
        else Path(ds.path)
    if ds.path.startswith("builtin:") and (folder is None or not folder.is_dir()):
        return DatasetPreview(note="the built-in dataset is generated when a run starts")
    if not ds.path.strip() or folder is None or not folder.is_dir():
        return DatasetPreview(note="choose a folder of images to see a preview")
    image, mask = first_image(folder, config.data.recursive)
    if image is None:
        return DatasetPreview(note=f"no image in {folder}")
    try:
        caption = image_caption(ds, folder, image, config.data.caption_extension)
    except (CaptionsFileError, OSError, UnicodeDecodeError) as exc:
        return DatasetPreview(image=image, note=f"caption unreadable: {exc}")
    rules = dataset_rules(ds)
    trained = transform_caption(caption, rules, random.Random(derive_seed("preview", draw)))
    overlay, source = (mask_overlay(image, mask, size) if config.data.masked_loss
                       else (None, ""))
    return DatasetPreview(image, caption, trained, rules.varies, overlay, source)
