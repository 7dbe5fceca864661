"""Which files of a dataset folder are images, and which are loss masks: `<image
stem>_mask.png` beside its image (docs/datasets.md).

Torch-free, so the GUI's dataset preview (modules/data/preview.py) lists a folder the way the
scan does.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp"})
MASK_SUFFIX = "_mask.png"


def mask_owner_stem(path: Path) -> str | None:
    """The image stem a `<stem>_mask.png` file belongs to, or None for any other file."""
    name = path.name
    if not name.lower().endswith(MASK_SUFFIX) or len(name) == len(MASK_SUFFIX):
        return None
    return name[:-len(MASK_SUFFIX)]


def split_masks(files: Sequence[Path], images: Sequence[Path]
                ) -> tuple[list[Path], dict[tuple[Path, str], Path]]:
    """(the images that are not masks, {(folder, lower-case image stem): its mask file}).

    A `x_mask.png` counts as a mask only when an image `x.*` lies beside it; otherwise it is
    an ordinary image."""
    stems = {(p.parent, p.stem.lower()) for p in images}
    masks: dict[tuple[Path, str], Path] = {}
    for path in files:
        stem = mask_owner_stem(path)
        if stem is not None and (path.parent, stem.lower()) in stems:
            masks[(path.parent, stem.lower())] = path
    mask_files = set(masks.values())
    return [p for p in images if p not in mask_files], masks
