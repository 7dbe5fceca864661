"""From probabilities to a loss mask (modules/data/prep/mask_ops.py): each option does what it
says, on arrays whose answer is known."""
from __future__ import annotations

import numpy as np
import pytest

from modules.data.prep.mask_ops import MaskShape, shape_mask


def square(side: int = 41, half: int = 5, value: float = 0.9) -> np.ndarray:
    """A `side` x `side` map, 0.1 everywhere but a centred square of `value`, 2*half+1 wide."""
    out = np.full((side, side), 0.1, np.float32)
    c = side // 2
    out[c - half:c + half + 1, c - half:c + half + 1] = value
    return out


def kept(mask) -> np.ndarray:
    return np.asarray(mask) > 127


def test_threshold_keeps_what_is_likely_enough_and_soft_keeps_grey():
    probabilities = square()
    assert kept(shape_mask(probabilities, (41, 41), MaskShape(threshold=0.5))).sum() == 11 * 11
    assert not kept(shape_mask(probabilities, (41, 41), MaskShape(threshold=0.95))).any()
    hard = np.asarray(shape_mask(probabilities, (41, 41), MaskShape(threshold=0.5)))
    assert set(np.unique(hard)) == {0, 255}
    soft = np.asarray(shape_mask(probabilities, (41, 41), MaskShape(threshold=None)))
    assert set(np.unique(soft)) == {26, 230}  # 0.1 and 0.9 of 255, rounded


def test_the_mask_has_the_size_it_is_asked_for():
    mask = shape_mask(square(32, 4), (100, 60), MaskShape())
    assert mask.mode == "L" and mask.size == (100, 60)
    rows, cols = np.nonzero(kept(mask))  # the square stays in the middle, stretched
    assert abs(rows.mean() - 30) < 2 and abs(cols.mean() - 50) < 2


@pytest.mark.parametrize("pixels", [1, 2, 6])
def test_dilate_grows_by_its_pixels_and_a_negative_one_shrinks(pixels):
    grown = kept(shape_mask(square(), (41, 41), MaskShape(dilate=pixels)))
    row = grown[20]  # through the middle: 11 kept pixels, then `pixels` more on each side
    assert row.sum() == 11 + 2 * pixels
    assert grown.sum() > 11 * 11
    shrunk = kept(shape_mask(square(), (41, 41), MaskShape(dilate=-pixels)))
    assert shrunk[20].sum() == max(0, 11 - 2 * pixels)  # 6 px shrinks it away


def test_a_large_dilation_is_close_to_round():
    grown = kept(shape_mask(square(81, 0), (81, 81), MaskShape(dilate=20)))
    assert grown[40].sum() == 41  # 20 each way along the axes
    diagonal = sum(grown[40 + i, 40 + i] for i in range(41))
    assert 14 <= diagonal <= 16  # an octagon's 15, not a square's 20 (nor a disk's 14)


def test_blur_softens_the_edge_only():
    sharp = np.asarray(shape_mask(square(), (41, 41), MaskShape()))
    blurred = np.asarray(shape_mask(square(), (41, 41), MaskShape(blur=2)))
    assert set(np.unique(sharp)) == {0, 255}
    assert len(np.unique(blurred)) > 10  # grey levels across the edge
    assert blurred[20, 20] > 250 and blurred[0, 0] == 0  # the middle and far corner stay


def test_invert_leaves_out_what_was_found_after_growing_it():
    inverted = kept(shape_mask(square(), (41, 41), MaskShape(dilate=2, invert=True)))
    assert inverted.sum() == 41 * 41 - (15 * 15 - 4)  # the grown octagon: 4 corners cut
    assert not inverted[20, 20] and inverted[0, 0]


@pytest.mark.parametrize("shape, field", [(MaskShape(threshold=1.5), "threshold"),
                                          (MaskShape(blur=-1), "blur"),
                                          (MaskShape(dilate=10_000), "dilate")])
def test_bad_options_are_named(shape, field):
    problems = shape.problems()
    assert len(problems) == 1 and problems[0].startswith(field)


def test_a_flat_output_that_gave_nan_makes_an_empty_mask():
    probabilities = np.full((8, 8), np.nan, np.float32)
    assert not np.asarray(shape_mask(probabilities, (8, 8), MaskShape(threshold=None))).any()
