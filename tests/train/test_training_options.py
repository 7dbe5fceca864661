"""Noise offset, min-SNR, caption dropout, EMA and text encoder output caching each do their job."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from modules.config import Config
from modules.config.schema import DatasetConfig
from modules.data.dataset import ImageCaptionDataset, collate_examples
from modules.data.folders import ScanItem
from modules.models.families import sd as sd_family
from modules.train.recipe import objectives
from modules.train.trainer import train
from tests.train.test_checkpoints import caption_folder


def _losses(result) -> list[float]:
    return json.loads((result.output_dir / "run.json").read_text())["losses"]


def _lora(result) -> dict:
    return load_file(result.output_dir / "final" / "pytorch_lora_weights.safetensors")


def test_min_snr_weights_follow_the_formula():
    alphas = torch.tensor([0.99, 0.5, 0.01])
    t = torch.tensor([0, 1, 2])
    snr = alphas / (1 - alphas)  # 99, 1, ~0.0101
    assert torch.allclose(sd_family.snr(alphas, t), snr)
    eps = objectives.min_snr_weights(snr, 5.0, "epsilon")
    assert torch.allclose(eps, torch.minimum(snr, torch.tensor(5.0)) / snr)
    assert eps[0] == pytest.approx(5 / 99) and eps[1] == pytest.approx(1.0)
    v = objectives.min_snr_weights(snr, 5.0, "v_prediction")
    assert torch.allclose(v, torch.minimum(snr, torch.tensor(5.0)) / (snr + 1))


def test_noise_offset_shifts_each_channel_by_a_constant():
    noise = torch.zeros(2, 4, 8, 8)
    draw = torch.randn(2, 4, 1, 1)
    shifted = objectives.offset_noise(noise, draw, 0.1)
    assert torch.allclose(shifted, 0.1 * draw.expand_as(noise))
    assert objectives.offset_noise(noise, draw, 0.0) is noise


def test_caption_dropout_empties_the_drawn_captions():
    captions = ["a", "b", "c"]
    assert objectives.drop_captions(captions, torch.tensor([0.05, 0.5, 0.09]),
                                    [0.1] * 3) == ["", "b", ""]
    assert objectives.drop_captions(captions, torch.tensor([0.0, 0.0, 0.0]),
                                    [0.0] * 3) == captions
    assert objectives.drop_captions(captions, torch.tensor([0.05, 0.05, 0.05]),
                                    [0.0, 0.1, 0.0]) == ["a", "", "c"]  # each its own


def test_each_dataset_drops_captions_at_its_own_rate_in_one_batch(tmp_path):
    """A batch mixing three datasets: dropout 1.0 always empties, 0.0 never does, unset uses
    data.caption_dropout; the draws are the step's usual uniform draws."""
    folder = caption_folder(tmp_path / "images", ["a", "b", "c"])
    images = sorted(folder.glob("*.png"))
    config = Config()
    config.data.caption_dropout = 0.3
    config.data.datasets = [DatasetConfig(caption_dropout=1.0), DatasetConfig(caption_dropout=0.0),
                            DatasetConfig()]
    items = [ScanItem(images[i % 3], f"caption {i}", source_index=i % 3) for i in range(6)]
    batch = collate_examples([ImageCaptionDataset(items, 64)[i] for i in range(6)])
    assert batch["source"] == [0, 1, 2, 0, 1, 2]
    assert objectives.caption_dropouts(config, batch["source"]) == [1.0, 0.0, 0.3] * 2
    thresholds = objectives.caption_dropouts(config, batch["source"])
    fixed = torch.tensor([0.999, 0.0, 0.2, 0.5, 0.0, 0.5])
    assert objectives.drop_captions(batch["caption"], fixed, thresholds) == [
        "", "caption 1", "", "", "caption 4", "caption 5"]           # 0.2 < 0.3 <= 0.5
    for draws in torch.rand((20, 6), generator=torch.Generator().manual_seed(0)):
        kept = objectives.drop_captions(batch["caption"], draws, thresholds)
        assert kept[0] == kept[3] == ""                               # dropout 1.0: always
        assert (kept[1], kept[4]) == ("caption 1", "caption 4")       # dropout 0.0: never


def test_each_option_changes_the_losses_and_off_means_off(tiny_config, tmp_path):
    """Also, from the same runs: a dataset's own caption dropout equal to the global one
    trains the same (same draws, same thresholds: setting it per dataset changes nothing
    else)."""
    def run(name, *overrides):
        return _losses(train(tiny_config(f"output.dir={tmp_path / name}",
                                         "training.max_steps=3", *overrides)))

    base = run("base")
    assert run("zeroes", "training.noise_offset=0", "training.min_snr_gamma=0",
               "data.caption_dropout=0") == base
    changed = {}
    for name, option in [("offset", "training.noise_offset=0.1"),
                         ("snr", "training.min_snr_gamma=5"),
                         ("dropout", "data.caption_dropout=0.5")]:
        changed[name] = run(name, option)
        assert changed[name] != base, f"{option} changed nothing"
    assert run("own", "data.datasets[0].caption_dropout=0.5") == changed["dropout"]


def test_ema_saves_averaged_weights_without_changing_training(tiny_config, tmp_path):
    plain = train(tiny_config(f"output.dir={tmp_path / 'plain'}", "training.max_steps=4"))
    ema = train(tiny_config(f"output.dir={tmp_path / 'ema'}", "training.max_steps=4",
                            "training.ema=true", "training.ema_decay=0.9"))
    assert _losses(plain) == _losses(ema), "EMA must not change the optimisation itself"
    live, averaged = _lora(plain), _lora(ema)
    assert live.keys() == averaged.keys()
    assert any(not torch.allclose(live[k], averaged[k]) for k in live)


def test_text_encoder_cache_encodes_each_caption_once_and_matches(tiny_config, tmp_path,
                                                                  monkeypatch):
    import dataclasses

    from modules.model_types import ModelType
    from modules.models.families import FAMILIES
    calls = []
    family = FAMILIES[ModelType.SD15]
    counting = dataclasses.replace(
        family, encode_text=lambda bundle, captions, device, encoders: calls.append(len(captions))
        or family.encode_text(bundle, captions, device, encoders))
    # 13 steps of 4: the 48 captions and 4 drawn again, so an encode per batch would be seen
    overrides = ["training.max_steps=13", "training.batch_size=4"]
    with monkeypatch.context() as patch:  # counts the cached run's encodes only
        patch.setitem(FAMILIES, ModelType.SD15, counting)
        cached = train(tiny_config(f"output.dir={tmp_path / 'c'}",
                                   "data.cache_text_encoder_outputs=true", *overrides))
    plain = train(tiny_config(f"output.dir={tmp_path / 'p'}", *overrides))
    dataset = Path(json.loads((cached.output_dir / "config.json").read_text())
                   ["data"]["datasets"][0]["path"])
    distinct = {caption.read_text().strip() for caption in dataset.glob("*.txt")}
    assert sum(calls) <= len(distinct), "a caption was encoded twice"
    assert _losses(cached) == pytest.approx(_losses(plain), rel=1e-5, abs=1e-6)
