"""Regularisation (class) images: kohya's balance rule, class captions, loss weights, refusals,
and a run with them that resumes exactly."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from modules.config.schema import DatasetConfig
from modules.config.validate import validate
from modules.data.dataset import ImageCaptionDataset, collate_examples, expand_repeats
from modules.data.errors import DatasetError
from modules.data.folders import DatasetSource, scan_datasets
from modules.data.regularization import balanced_repeats, regularization_repeats
from modules.config.loss import LossType
from modules.train.recipe.objectives import diffusion_loss, elementwise_loss, sample_weights
from tests.data.test_folders import make_image


def diffusion_mse(prediction, target, weights, mask=None):
    """The training step's MSE loss: per element, then reduced with weights and mask."""
    return diffusion_loss(elementwise_loss(prediction, target, LossType.MSE), weights, mask)


@pytest.mark.parametrize("train, own, expected", [
    (10, [1, 1, 1], [4, 3, 3]),        # too few: one more repeat each, in turn, until equal
    (3, [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]),  # too many: the first ones, the rest unused
    (3, [2, 2, 2], [2, 2, 0]),         # own repeats kept: the count may pass the training's
    (7, [2, 2], [4, 3]),
    (4, [2, 2], [2, 2]),               # already equal: unchanged
    (5, [], []),
])
def test_regularization_repeats_follow_kohyas_rule(train, own, expected):
    counts = regularization_repeats(train, own)
    assert counts == expected
    if own and sum(own) < train:
        assert sum(counts) == train


def folders(tmp_path: Path, train_images: int = 3, reg_images: int = 4) -> tuple[Path, Path]:
    for i in range(train_images):
        make_image(tmp_path / "train" / f"t{i}.png", caption=f"sks dog {i}")
    for i in range(reg_images):
        make_image(tmp_path / "reg" / f"r{i}.png", color=(30, 30, 200))
    make_image(tmp_path / "reg" / "captioned.png", color=(30, 200, 30), caption="a dog, grass")
    return tmp_path / "train", tmp_path / "reg"


def test_an_epoch_mixes_as_many_class_samples_as_training_samples(tmp_path):
    train, reg = folders(tmp_path)
    scan = scan_datasets([DatasetSource(train, repeats=2),
                          DatasetSource(reg, default_caption="a photo of a dog",
                                        regularization=True)])
    repeats, balance = balanced_repeats(scan)
    # 3 images x 2 = 6 training samples; 5 class images: one each, then the first one again
    assert balance.train_samples == 6 and balance.regularization_samples == 6
    assert balance.regularization_unused == 0
    items = expand_repeats(scan)
    reg_items = [i for i in items if i.source_index == 1]
    assert len(items) == 12 and len(reg_items) == 6
    counts = {i.path.name: reg_items.count(i) for i in reg_items}
    assert counts == {"captioned.png": 2, "r0.png": 1, "r1.png": 1, "r2.png": 1, "r3.png": 1}
    captions = {i.path.name: i.caption for i in scan.items if i.source_index == 1}
    assert captions["r0.png"] == "a photo of a dog"  # no caption file: the class caption
    assert captions["captioned.png"] == "a dog, grass"  # its own file wins
    assert not scan.missing_captions


def test_more_class_images_than_training_samples_leaves_the_last_ones_out(tmp_path):
    train, reg = folders(tmp_path, train_images=2, reg_images=4)
    scan = scan_datasets([DatasetSource(train), DatasetSource(reg, regularization=True)])
    _, balance = balanced_repeats(scan)
    assert (balance.regularization_samples, balance.regularization_unused) == (2, 3)
    assert "3 class images are never used" in balance.describe()


def test_only_class_images_found_is_refused_by_the_scan(tmp_path):
    _, reg = folders(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetError, match="only regularisation images"):
        scan_datasets([DatasetSource(empty), DatasetSource(reg, regularization=True)])
    train, _ = folders(tmp_path)
    with pytest.raises(DatasetError, match=f"regularisation folder.*{empty.name}.*no usable"):
        scan_datasets([DatasetSource(train), DatasetSource(empty, regularization=True)])


def test_config_refusals(tiny_config):
    only_reg = tiny_config("data.datasets[0].regularization=true")
    assert [p.path for p in validate(only_reg)] == ["data.datasets"]
    stray = tiny_config("training.prior_loss_weight=0.5")
    assert [p.path for p in validate(stray)] == ["training.prior_loss_weight"]
    fine = tiny_config("training.prior_loss_weight=0.5")
    fine.data.datasets.append(DatasetConfig(path="builtin:shapes", regularization=True))
    assert validate(fine) == []


def test_the_weighted_loss_is_the_mean_of_weighted_sample_losses():
    torch.manual_seed(0)
    prediction, target = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    per_sample = ((prediction - target) ** 2).mean(dim=(1, 2, 3))
    w = torch.tensor([1.0, 0.25, 1.0])  # sample 1 is a class image, prior_loss_weight 0.25
    expected = (per_sample[0] + 0.25 * per_sample[1] + per_sample[2]) / 3
    assert torch.allclose(diffusion_mse(prediction, target, sample_weights(None, w)), expected)
    snr = torch.tensor([0.5, 2.0, 1.0])
    both = diffusion_mse(prediction, target, sample_weights(snr, w))
    assert torch.allclose(both, (per_sample * snr * w).mean())
    assert sample_weights(snr, None) is snr
    assert torch.equal(diffusion_mse(prediction, target, sample_weights(None, None)),
                       F.mse_loss(prediction, target))


def test_batches_carry_each_sources_weight_only_when_given(tmp_path):
    train, reg = folders(tmp_path, train_images=1, reg_images=0)
    scan = scan_datasets([DatasetSource(train), DatasetSource(reg, regularization=True)])
    items = expand_repeats(scan)
    weighted = ImageCaptionDataset(items, 64, loss_weights=[1.0, 0.5])
    batch = collate_examples([weighted[i] for i in range(len(items))])
    assert batch["loss_weight"].tolist() == [1.0, 0.5]
    plain = ImageCaptionDataset(items, 64)
    assert "loss_weight" not in collate_examples([plain[0]])


def test_a_run_with_class_images_resumes_exactly_and_records_the_mix(tiny_config, tmp_path):
    from tests.train.test_resume import final_tensors, run_json, stop_then_resume
    from modules.events import RecordingCallbacks
    from modules.train.trainer import train as run_training
    _, reg = folders(tmp_path, train_images=0, reg_images=3)

    def config(name):
        made = tiny_config("training.max_steps=4", "training.prior_loss_weight=0.5",
                           f"output.dir={tmp_path / name}")
        made.data.datasets.append(DatasetConfig(path=str(reg), regularization=True,
                                                class_caption="a photo of a shape"))
        return made

    run_training(config("whole"), RecordingCallbacks())
    stop_then_resume(config("parts"), at=2)
    whole, parts = run_json(tmp_path / "whole"), run_json(tmp_path / "parts")
    assert parts["losses"] == whole["losses"]
    want, have = final_tensors(tmp_path / "whole"), final_tensors(tmp_path / "parts")
    assert all(torch.equal(want[k], have[k]) for k in want)
    mix = whole["regularization"]
    assert mix["regularization_samples"] == mix["train_samples"] > 0
    unweighted = config("unweighted")
    unweighted.training.prior_loss_weight = 1.0
    run_training(unweighted, RecordingCallbacks())
    assert run_json(tmp_path / "unweighted")["losses"] != whole["losses"]
