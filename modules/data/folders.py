"""Scanning dataset folders: which images train, with which captions, and what was skipped.

Layout (the kohya / OneTrainer convention): a folder of images, each with a same-name caption
file next to it (`cat.png` + `cat.txt`); with `recursive`, subfolders too, where a top-level
subfolder named `N_name` (kohya's `10_subject`) repeats its images N times per epoch. Every image is decoded once here, so a corrupt file is
skipped with a reason at scan time instead of crashing a run hours in; the same pass reads
each image's oriented size, which aspect-ratio bucketing needs.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modules.data.errors import DatasetError
from modules.data.images import IMAGE_EXTENSIONS, inspect_image, is_image_file, oriented_size
from modules.data.file_kinds import split_masks
from modules.data.masks import check_mask, mask_is_blank
from modules.data.progress import ProgressCallback
from modules.util.cores import usable_cores

logger = logging.getLogger("tempera.data")

# Image formats users bring from other tools that Tempera does not load: reported as skipped
# (so nobody wonders why their .bmp files never trained) rather than ignored like a .json.
UNSUPPORTED_IMAGE_EXTENSIONS = frozenset({".bmp", ".gif", ".tif", ".tiff", ".avif", ".heic",
                                          ".heif", ".jxl"})
_LISTED_NAMES = 5  # how many file names a summary message lists before "..."
# kohya's repeat prefix on a dataset's top-level subfolder: "10_subject" = 10 repeats
REPEAT_PREFIX = re.compile(r"^(\d+)_(.+)$")
# An image whose short side is below this fraction of the training resolution is upscaled
# so much that it trains mostly blur: warned about, still used.
SMALL_IMAGE_FRACTION = 0.25


@dataclass(frozen=True)
class DatasetSource:
    """One dataset folder, how many times each of its images is seen per epoch, and captions
    from a metadata file (image name or folder-relative path -> caption), which win over the
    images' caption files. `default_caption` is the caption of an image that has neither
    (kohya's class tokens); `regularization` marks a folder of class images
    (modules/data/regularization.py)."""
    path: Path
    repeats: int = 1
    captions: Mapping[str, str] | None = field(default=None, compare=False, hash=False)
    default_caption: str = ""
    regularization: bool = False


@dataclass(frozen=True)
class ScanItem:
    """One usable image: its file, its caption ("" when it has none) and its source's index.

    `size` is (height, width) after EXIF rotation, as the scan read it (None for an item made
    by hand; bucketing then reads the file's header).
    """
    path: Path
    caption: str
    source_index: int
    has_caption: bool = True
    size: tuple[int, int] | None = None
    repeats: int = 1  # from a kohya-style "N_name" subfolder; times its source's repeats
    repeat_folder: str = ""  # that "N_name" subfolder's name ("" when it is in none)
    mask: Path | None = None  # its `<stem>_mask.png` (modules/data/masks.py)
    alpha: bool = False       # it has transparency: its mask when it has no mask file

    def oriented_size(self) -> tuple[int, int]:
        """(height, width) after EXIF rotation: the scan's, or the file header's."""
        return self.size if self.size is not None else oriented_size(self.path)


@dataclass
class ScanResult:
    """What `scan_datasets` found: usable items (sorted), skipped files with reasons, counts."""
    sources: tuple[DatasetSource, ...]
    items: list[ScanItem] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    missing_captions: list[Path] = field(default_factory=list)
    hidden_ignored: int = 0
    images_per_source: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # quiet oddities, each one line
    folder_repeats: dict[str, tuple[int, int]] = field(default_factory=dict)  # name: (N, images)
    # a source's captions file: the names in it that name no image of its folder, by source
    unmatched_captions: dict[int, list[str]] = field(default_factory=dict)
    blank_masks: list[Path] = field(default_factory=list)  # images whose mask keeps no pixel

    @property
    def num_images(self) -> int:
        return len(self.items)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    @property
    def num_missing_captions(self) -> int:
        return len(self.missing_captions)

    @property
    def num_samples_per_epoch(self) -> int:
        """Images per epoch once each source's repeats are applied."""
        return sum(self.sources[item.source_index].repeats * item.repeats for item in self.items)

    def summary(self) -> str:
        """One line for the run log: images, samples per epoch, skips, missing captions, and
        the kohya-style repeat folders."""
        line = (f"{self.num_images} images ({self.num_samples_per_epoch} samples per epoch with "
                f"repeats) from {len(self.sources)} folder(s); {self.num_skipped} skipped; "
                f"{self.num_missing_captions} without a caption file")
        if self.folder_repeats:
            line += "; repeat folders: " + ", ".join(
                f"{name} ({count} images x{n})" for name, (n, count) in
                sorted(self.folder_repeats.items()))
        return line


def scan_datasets(sources: Sequence[DatasetSource], caption_extension: str = ".txt",
                  recursive: bool = False, check_threads: int | None = None,
                  resolution: int | None = None,
                  progress: Callable[[Path], ProgressCallback] | None = None,
                  check_masks: bool = False) -> ScanResult:
    """Scan every source folder into a sorted list of usable images with captions.

    Only files directly in each folder are read unless `recursive` (then subfolders too, each
    image's caption next to it). Hidden files and folders (names starting with ".", e.g.
    macOS "._x.jpg") are ignored and counted. Raises DatasetError when a folder is missing, a
    repeat count is below 1, or no usable image is found anywhere (the message names the
    folders and the skip reasons). Images are decoded on `check_threads` threads (default: up
    to 8; PIL releases the GIL while decoding); the result does not depend on the count.
    With `resolution`, images far smaller than it are listed in `warnings`. `progress(folder)`
    gives the callback told (images checked, images in the folder) as each image decodes.
    Mask files (`<stem>_mask.png` beside an image) are never images; with `check_masks`
    (data.masked_loss) each must decode at its image's size, else DatasetError names it.
    """
    extension = normalize_caption_extension(caption_extension)
    _check_sources(sources)
    threads = check_threads or min(8, usable_cores())
    result = ScanResult(sources=tuple(sources))
    for index, source in enumerate(sources):
        before = result.num_images
        _scan_folder(Path(source.path), index, extension, recursive, threads, result,
                     source.captions or {}, progress(Path(source.path)) if progress else None,
                     source.default_caption.strip())
        found = result.num_images - before
        result.images_per_source.append(found)
        if found == 0:
            logger.warning("dataset folder %s has no usable images", source.path)
    _report_missing_captions(result, extension)
    _warn_small_images(result, resolution)
    if result.hidden_ignored:
        logger.info("ignored %d hidden file(s) in the dataset folders", result.hidden_ignored)
    if result.num_images == 0:
        raise DatasetError(_no_images_message(result, recursive))
    _check_training_images(result)
    if check_masks:
        _check_masks(result)
    logger.info("dataset: %s", result.summary())
    return result


def _check_masks(result: ScanResult) -> None:
    """Every mask file decodes and has its image's size (data.masked_loss): one DatasetError
    naming each bad file. Images whose mask (file or alpha channel) keeps no pixel at all
    are listed in `blank_masks`: their loss is exactly 0 (an inverted mask does this)."""
    problems = []
    for item in result.items:
        if item.mask is None and not item.alpha:
            continue
        why = check_mask(item.mask, item.size) if item.mask is not None else None
        if why:
            problems.append(why)
        elif mask_is_blank(item.mask, item.path, item.alpha):
            result.blank_masks.append(item.path)
    if problems:
        raise DatasetError("bad mask file(s): " + "; ".join(problems))


def _check_training_images(result: ScanResult) -> None:
    """Regularisation images alone train nothing: at least one training image is needed; and
    a regularisation folder without a usable image is a mistake, not an empty prior."""
    empty = [str(s.path) for s, n in zip(result.sources, result.images_per_source)
             if s.regularization and n == 0]
    if empty:
        raise DatasetError(f"the regularisation folder(s) {', '.join(empty)} hold no usable "
                           "image; add class images or untick regularisation")
    if all(result.sources[item.source_index].regularization for item in result.items):
        folders = ", ".join(str(s.path) for s in result.sources if not s.regularization)
        raise DatasetError("only regularisation images were found; the training folders "
                           f"({folders or 'none is configured'}) hold no usable image")


def normalize_caption_extension(caption_extension: str) -> str:
    """'.txt' for 'txt' or '.txt'; rejects an empty extension (it would match the image)."""
    extension = caption_extension.strip()
    if extension in ("", "."):
        raise DatasetError("the caption extension is empty; use e.g. '.txt'")
    return extension if extension.startswith(".") else f".{extension}"


def _check_sources(sources: Sequence[DatasetSource]) -> None:
    """Raise one DatasetError listing every bad source (missing folder, repeats < 1)."""
    problems = []
    if not sources:
        problems.append("no dataset folders are configured")
    for source in sources:
        path = Path(source.path)
        if not path.exists():
            problems.append(f"dataset folder does not exist: {path}")
        elif not path.is_dir():
            problems.append(f"dataset path is not a folder: {path}")
        if source.repeats < 1:
            problems.append(f"repeats must be at least 1 for {path} (got {source.repeats})")
    if problems:
        raise DatasetError("; ".join(problems))


def _scan_folder(folder: Path, source_index: int, caption_extension: str, recursive: bool,
                 threads: int, result: ScanResult, listed: Mapping[str, str],
                 progress: ProgressCallback | None = None, default_caption: str = "") -> None:
    """Append this folder's usable images to `result.items`, its bad files to `skipped`; an
    image without a caption gets `default_caption` when one is given."""
    files, hidden, broken = list_folder_files(folder, recursive)
    result.hidden_ignored += hidden
    if broken:
        result.warnings.append(f"{len(broken)} symbolic link(s) point to nothing and were "
                               f"left out: {_list_names(broken)}")
    captions = {(f.parent, f.name.lower()): f for f in files
                if f.suffix.lower() == caption_extension.lower()}
    for path in files:
        if path.suffix.lower() in UNSUPPORTED_IMAGE_EXTENSIONS:
            _skip(result, path, "unsupported image format (use "
                                f"{'/'.join(sorted(IMAGE_EXTENSIONS))})")
    images, masks = split_masks(files, [path for path in files if is_image_file(path)])
    empty: list[Path] = []
    matched: set[str] = set()  # the captions file's names that named an image
    checks = []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for check in pool.map(inspect_image, images):  # map keeps the sorted order
            checks.append(check)
            if progress is not None:
                progress(len(checks), len(images))
    for path, check in zip(images, checks):
        if check.reason is not None:
            _skip(result, path, check.reason)
            continue
        repeats, repeat_folder = _folder_repeats(folder, path, result)
        found: dict[str, Any] = {"size": check.size, "repeats": repeats, "repeat_folder": repeat_folder,
                 "alpha": check.alpha, "mask": masks.get((path.parent, path.stem.lower()))}
        relative = path.relative_to(folder).as_posix()
        if relative in listed or path.name in listed:
            matched.add(relative if relative in listed else path.name)
            caption = listed.get(relative, listed.get(path.name, ""))
            if not caption:
                empty.append(path)
            result.items.append(ScanItem(path, caption, source_index, **found))
            continue
        caption_path = captions.get((path.parent, (path.stem + caption_extension).lower()))
        if caption_path is None and default_caption:
            result.items.append(ScanItem(path, default_caption, source_index, **found))
            continue
        if caption_path is None:
            result.missing_captions.append(path)
            result.items.append(ScanItem(path, "", source_index, has_caption=False, **found))
            continue
        try:
            caption = caption_path.read_text(encoding="utf-8-sig").strip()  # -sig: Notepad BOM
        except (OSError, UnicodeDecodeError) as exc:
            _skip(result, path, f"caption file {caption_path.name} is unreadable: {exc}")
            continue
        if not caption:
            empty.append(caption_path)
        result.items.append(ScanItem(path, caption, source_index, **found))
    if empty:
        result.warnings.append(f"{len(empty)} caption file(s) are empty (those images train "
                               f"unconditioned): {_list_names(empty)}")
    if len(matched) < len(listed):
        result.unmatched_captions[source_index] = sorted(set(listed) - matched)


def list_folder_files(folder: Path, recursive: bool) -> tuple[list[Path], int, list[Path]]:
    """Visible files under `folder` sorted by relative path, the number of hidden ones, and the
    symbolic links that point to nothing."""
    candidates = folder.rglob("*") if recursive else folder.iterdir()
    visible, hidden, broken = [], 0, []
    for path in candidates:
        if any(part.startswith(".") for part in path.relative_to(folder).parts):
            hidden += path.is_file()
            continue
        if path.is_symlink() and not path.exists():
            broken.append(path)
        elif path.is_file():
            visible.append(path)
    visible.sort(key=lambda p: p.relative_to(folder).as_posix())
    return visible, hidden, sorted(broken)


def _folder_repeats(root: Path, path: Path, result: ScanResult) -> tuple[int, str]:
    """(N, the subfolder's name) for an image under a top-level subfolder named "N_name"
    (kohya), else (1, "")."""
    parts = path.relative_to(root).parts
    match = REPEAT_PREFIX.match(parts[0]) if len(parts) > 1 else None
    if match is None or int(match.group(1)) < 1:
        return 1, ""
    n, count = result.folder_repeats.get(parts[0], (int(match.group(1)), 0))
    result.folder_repeats[parts[0]] = (n, count + 1)
    return n, parts[0]


def _warn_small_images(result: ScanResult, resolution: int | None) -> None:
    if not resolution:
        return
    limit = resolution * SMALL_IMAGE_FRACTION
    small = [item.path for item in result.items if item.size and min(item.size) < limit]
    if small:
        result.warnings.append(f"{len(small)} image(s) have a side under {limit:.0f} px, far "
                               f"below the training resolution {resolution} (they are upscaled "
                               f"and train mostly blur): {_list_names(small)}")


def _skip(result: ScanResult, path: Path, reason: str) -> None:
    logger.warning("skipping %s: %s", path, reason)
    result.skipped.append((path, reason))


def _report_missing_captions(result: ScanResult, caption_extension: str) -> None:
    if result.missing_captions:
        logger.warning("%d image(s) have no %s caption file and train with an empty caption: %s",
                       result.num_missing_captions, caption_extension,
                       _list_names(result.missing_captions))


def _no_images_message(result: ScanResult, recursive: bool) -> str:
    folders = ", ".join(str(s.path) for s in result.sources)
    message = f"no usable images in {folders}"
    if not recursive:
        nested = _images_in_subfolders(result)
        if nested:
            return (message + "; its subfolders hold images (" + ", ".join(
                f"{name}: {count}" for name, count in nested) + "): set data.recursive = true "
                "to train them (a subfolder named N_name repeats its images N times)")
    if not result.skipped:
        return message + f" (no {'/'.join(sorted(IMAGE_EXTENSIONS))} files found)"
    shown = "; ".join(f"{path.name}: {reason}" for path, reason in result.skipped[:_LISTED_NAMES])
    more = "; ..." if result.num_skipped > _LISTED_NAMES else ""
    return f"{message}: {result.num_skipped} file(s) skipped ({shown}{more})"


def _list_names(paths: Sequence[Path]) -> str:
    names = ", ".join(p.name for p in paths[:_LISTED_NAMES])
    return names + (", ..." if len(paths) > _LISTED_NAMES else "")


def _images_in_subfolders(result: ScanResult) -> list[tuple[str, int]]:
    """(subfolder, image count) of the sources' subfolders: what `recursive` would add."""
    found = []
    for source in result.sources:
        for sub in sorted(p for p in Path(source.path).iterdir()
                          if p.is_dir() and not p.name.startswith(".")):
            count = sum(1 for f in sub.rglob("*") if f.is_file() and is_image_file(f))
            if count:
                found.append((sub.name, count))
    return found
