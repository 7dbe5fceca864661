"""Which images validation scores, decided when a run is checked (after the dataset scan, before
the model loads): a fraction held out of the training images, or a separate folder.

Refusals that only the scan can tell (a fraction that leaves no image on one side, a folder
without a usable image) are ConfigErrors with the counts, so a start fails before anything is
written, the same way in the GUI, `tempera-train` and `--check`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from modules.config.problems import ConfigError, Problem
from modules.config.schema import Config
from modules.data.captions import CaptionRules
from modules.data.folders import DatasetError, DatasetSource, ScanItem, ScanResult, scan_datasets
from modules.data.split import held_out_count, split_items, splittable_items, without_items

if TYPE_CHECKING:  # torch-free at import: the GUI's checks read this file
    from modules.train.recipe.builders import Draws


@dataclass(frozen=True)
class ValidationImages:
    """The images validation scores, with the caption rules they are read under."""
    items: tuple[ScanItem, ...]
    rules: tuple[CaptionRules, ...]  # by source index; () reads captions as written
    origin: str                      # "held out: 2 of 10 images", "folder /data/val"


def choose_validation(config: Config, scan: ScanResult
                      ) -> tuple[ScanResult, ValidationImages | None]:
    """(the scan training uses, the validation images or None). With `split_ratio` the
    held-out images leave the training scan. Raises ConfigError when a side would be empty."""
    v = config.validation
    if not v.every_steps:
        return scan, None
    if v.folder:
        return scan, folder_images(config)
    train_items, held = split_items(scan, v.split_ratio, config.training.seed)
    images = len(splittable_items(scan))  # class images are never held out
    if not held or len(held) == images:
        side = "no validation image" if not held else "no training image"
        fix = (f"raise it to at least {least_ratio(images)}" if not held
               else "lower it or add images")
        raise ConfigError([Problem(
            "validation.split_ratio", "a fraction that leaves images on both sides",
            f"{v.split_ratio:g}", f"{v.split_ratio:g} of the dataset's {images} "
            f"training images holds out {held_out_count(images, v.split_ratio)}: {side} "
            f"would be left; {fix}, or use validation.folder")])
    rules = tuple(CaptionRules(ds.caption_prefix, ds.caption_suffix)
                  for ds in config.data.datasets)  # trigger words yes, no shuffle or dropout
    origin = f"held out: {len(held)} of {len(scan.items)} images (not trained)"
    return without_items(scan, train_items), ValidationImages(tuple(held), rules, origin)


def least_ratio(images: int) -> str:
    """The smallest fraction (two decimals) that holds one of `images` out."""
    for hundredths in range(1, 51):
        if held_out_count(images, hundredths / 100) >= 1:
            return f"{hundredths / 100:g}"
    return "0.5"


def folder_images(config: Config) -> ValidationImages:
    """validation.folder's usable images, with captions as written (CaptionRules none)."""
    folder = Path(config.validation.folder)
    try:
        scan = scan_datasets([DatasetSource(folder)],
                             caption_extension=config.data.caption_extension,
                             recursive=config.data.recursive,
                             check_masks=config.data.masked_loss)
    except DatasetError as exc:
        raise ConfigError([Problem("validation.folder", "a folder with at least one readable "
                                   "image", repr(str(folder)), str(exc))]) from exc
    return ValidationImages(tuple(scan.items), (), f"folder {folder}: {len(scan.items)} images")


@dataclass
class Validator:
    """What a run scores (`Run.validator`): the images and, after the first pass, their
    fixed batches (latents on the CPU, with their draws)."""
    images: ValidationImages
    batch_size: int
    timestep_count: int
    seed: int
    batches: list[tuple[dict, Draws]] | None = None
    last_seconds: float | None = None  # the latest pass's duration, for the ETA

    @property
    def count(self) -> int:
        return len(self.images.items)


def build_validator(config, images: ValidationImages | None) -> Validator | None:
    """The run's validator, or None when validation is off."""
    if images is None or not config.validation.every_steps:
        return None
    v = config.validation
    return Validator(images, v.batch_size or config.training.batch_size, v.timesteps,
                     config.training.seed)
