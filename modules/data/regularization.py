"""Regularisation (class) images for DreamBooth-style prior preservation, balanced kohya's way.

A dataset marked `regularization` holds images of the subject's class ("a photo of a dog")
that keep the model from forgetting what the class looks like while it learns the subject.
Its samples are mixed into the same batches as the training samples, and their loss counts
`training.prior_loss_weight` times (`modules/train/recipe/objectives.py: sample_weights`).

How many regularisation samples an epoch holds follows kohya's sd-scripts, so a dataset laid
out for it trains the same: an epoch sees as many regularisation samples as training samples.
The regularisation images are taken in scan order (folder order, then file order), each with
its own repeats, until their count reaches the training samples; if they run out first, each
image gets one more repeat in turn until it does. Images after the point where the count was
reached are not used at all (every epoch uses the same ones).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modules.data.folders import ScanItem, ScanResult


@dataclass(frozen=True)
class Balance:
    """What `balanced_repeats` decided: samples per epoch on each side, images left out."""
    train_samples: int
    regularization_samples: int
    regularization_images: int
    regularization_unused: int

    def describe(self) -> str:
        """One line for the run's status."""
        line = (f"regularisation: {self.regularization_samples} class-image samples per epoch "
                f"for {self.train_samples} training samples "
                f"({self.regularization_images - self.regularization_unused} of "
                f"{self.regularization_images} class images used)")
        if self.regularization_unused:
            line += (f"; {self.regularization_unused} class images are never used (more than "
                     "the training samples, as in kohya's sd-scripts)")
        return line


def regularization_repeats(train_samples: int, own_repeats: Sequence[int]) -> list[int]:
    """Each regularisation image's repeats per epoch, given its own repeats (in scan order).

    kohya's rule (see the module docstring): first every image with its own repeats, in order,
    until the total reaches `train_samples` (the rest get 0); if all were taken and the total
    is still short, one more repeat each, in turn, until it reaches `train_samples` exactly.
    """
    counts = [0] * len(own_repeats)
    total = 0
    for i, repeats in enumerate(own_repeats):
        if total >= train_samples:
            break
        counts[i] = repeats
        total += repeats
    while own_repeats and total < train_samples:
        for i in range(len(counts)):
            counts[i] += 1
            total += 1
            if total >= train_samples:
                break
    return counts


def item_repeats(scan: ScanResult, item: ScanItem) -> int:
    """An item's own repeats: its folder's `repeats` times its kohya `N_name` subfolder's N."""
    return scan.sources[item.source_index].repeats * item.repeats


def is_regularization(scan: ScanResult, item: ScanItem) -> bool:
    return scan.sources[item.source_index].regularization


def balanced_repeats(scan: ScanResult) -> tuple[list[int], Balance | None]:
    """Every scanned item's repeats per epoch (same order as `scan.items`), regularisation
    images balanced against the training samples; the Balance is None without any."""
    own = [item_repeats(scan, item) for item in scan.items]
    reg = [i for i, item in enumerate(scan.items) if is_regularization(scan, item)]
    if not reg:
        return own, None
    reg_set = set(reg)
    train_samples = sum(r for i, r in enumerate(own) if i not in reg_set)
    counts = regularization_repeats(train_samples, [own[i] for i in reg])
    for i, count in zip(reg, counts):
        own[i] = count
    balance = Balance(train_samples, sum(counts), len(reg), sum(1 for c in counts if c == 0))
    return own, balance
