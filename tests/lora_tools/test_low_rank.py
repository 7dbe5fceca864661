"""resize's low-rank approximation from a LoRA's own factors equals the dense SVD of its update
(what it replaced), and a whole SD 1.5-size LoRA is resized that way: the dense SVD is never
run, each layer is the update's best approximation by torch's own SVD, and each layer is
reported as it is done."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from modules.cli.lora import main
from modules.lora_tools.low_rank import low_rank, low_rank_of_factors

CASES = [  # (out, rank, in): a Linear layer, a 3x3 convolution flattened, a layer narrower
    (64, 8, 48), (40, 6, 16 * 9), (3, 6, 20), (24, 5, 4)]  # than its rank, both sides


@pytest.mark.parametrize("out_features, rank, in_features", CASES)
def test_the_factor_path_gives_the_dense_svd_result(out_features, rank, in_features):
    generator = torch.Generator().manual_seed(out_features)
    up = torch.randn(out_features, rank, generator=generator)
    down = torch.randn(rank, in_features, generator=generator) * 0.1
    dense_update = up.double() @ down.double()
    for new_rank in sorted({1, max(1, rank // 2), rank}):
        f_up, f_down, f_share = low_rank_of_factors(up, down, new_rank)
        d_up, d_down, d_share = low_rank(dense_update, new_rank)
        assert f_up.shape == d_up.shape == (out_features, new_rank)
        assert f_down.shape == d_down.shape == (new_rank, in_features)
        assert f_up.dtype == f_down.dtype == torch.float32
        # the factors' signs are the SVD's choice; their product is the approximation
        scale = float(dense_update.abs().max())
        torch.testing.assert_close(f_up.double() @ f_down.double(),
                                   d_up.double() @ d_down.double(), rtol=0, atol=1e-6 * scale)
        assert f_share == pytest.approx(d_share, abs=1e-10)
        s = torch.linalg.svdvals(dense_update)
        assert f_share == pytest.approx(float((s[:new_rank] ** 2).sum() / (s ** 2).sum()),
                                        abs=1e-10)


def test_a_rank_deficient_update_keeps_everything_at_its_true_rank():
    """Two equal columns of up: the update has rank 3 of 4, so rank 3 keeps all of it."""
    generator = torch.Generator().manual_seed(5)
    up = torch.randn(16, 3, generator=generator)
    up = torch.cat([up, up[:, :1]], dim=1)
    down = torch.randn(4, 12, generator=generator)
    f_up, f_down, share = low_rank_of_factors(up, down, 3)
    assert share == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(f_up @ f_down, up @ down, rtol=1e-5, atol=1e-5)


def _full_size_lora(path, generator):
    """A kohya LoRA at full SD 1.5 size (rank 8, alpha 4) on the cross-attention q and k of
    the UNet's first down block, and one of its ResNet convolutions (LoCon, rank 4): the
    tensor shapes the shipped configs give, random factors. (The first block's 320 channels
    keep the test's own dense SVDs cheap: a 1280-wide one takes 20 s on a busy 2-core CI.)"""
    tensors = {}
    for attention, proj in ((a, p) for a in range(2) for p in ("to_q", "to_k")):
        source = 320 if proj == "to_q" else 768  # attn2 reads the text's 768 features
        name = f"lora_unet_down_blocks_0_attentions_{attention}_transformer_blocks_0_attn2_{proj}"
        tensors[f"{name}.lora_down.weight"] = torch.randn(8, source, generator=generator)
        tensors[f"{name}.lora_up.weight"] = torch.randn(320, 8, generator=generator) * 0.01
        tensors[f"{name}.alpha"] = torch.tensor(4.0)
    conv = "lora_unet_down_blocks_0_resnets_0_conv1"
    tensors[f"{conv}.lora_down.weight"] = torch.randn(4, 320, 3, 3, generator=generator)
    tensors[f"{conv}.lora_up.weight"] = torch.randn(320, 4, 1, 1, generator=generator) * 0.01
    tensors[f"{conv}.alpha"] = torch.tensor(4.0)
    save_file(tensors, str(path))
    return tensors


def test_resize_at_full_size_works_from_the_factors_and_reports_each_layer(
        tmp_path, capsys, monkeypatch):
    """Over 10 s when it is the first to build SD 1.5's full-size layout on the meta device
    (diffusers' import and the model's construction: 26 s measured on a busy 2-core machine);
    the resize itself and the test's references are a few seconds."""
    import modules.lora_tools.operations as operations

    def no_dense_svd(*args, **kwargs):
        raise AssertionError("resize ran a dense SVD of a layer's whole update")
    monkeypatch.setattr(operations, "low_rank", no_dense_svd)
    source, out = tmp_path / "big.safetensors", tmp_path / "small.safetensors"
    tensors = _full_size_lora(source, torch.Generator().manual_seed(0))
    assert main(["resize", "--model-type", "sd15", "--lora", str(source), "--rank", "3",
                 "-o", str(out)]) == 0
    captured = capsys.readouterr()
    names = sorted({k.split(".")[0] for k in tensors})
    progress = [line for line in captured.err.splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in progress] == [
        f"[{i}/{len(names)}" for i in range(1, len(names) + 1)]
    assert captured.out.splitlines()[0] == f"written: {out}"  # the result first
    result = load_file(str(out))
    for name in names:
        down, up = tensors[f"{name}.lora_down.weight"], tensors[f"{name}.lora_up.weight"]
        update = (4.0 / down.shape[0]) * (up.flatten(1).double() @ down.flatten(1).double())
        # Eckart–Young by another route than the tool's: the update projected onto its top 3
        # left singular vectors, the eigenvectors of ΔW ΔWᵀ (its out x out Gram matrix)
        _, vectors = torch.linalg.eigh(update @ update.T)
        top = vectors[:, -3:]
        best = top @ (top.T @ update)
        new_down, new_up = result[f"{name}.lora_down.weight"], result[f"{name}.lora_up.weight"]
        assert new_down.shape[0] == 3 and new_up.shape[1] == 3
        ours = float(result[f"{name}.alpha"]) / 3 * (new_up.flatten(1).double()
                                                     @ new_down.flatten(1).double())
        torch.testing.assert_close(ours, best, rtol=0, atol=1e-5 * float(best.abs().max()))
    assert all(" -> 3, error " in line for line in progress)  # each names its layer's result
