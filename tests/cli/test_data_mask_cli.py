"""`tempera-data mask FOLDER` (modules/cli/data_mask.py, a row of modules/cli/data.py): masks
written with a progress bar, one-line refusals with exit 2, the options reaching the job."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from modules.cli import data as cli
from tests.data.prep.tiny_mask_models import build_tiny_background, build_tiny_clipseg

pytest.importorskip("rembg", reason="the `data` extra (rembg) removes backgrounds")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mask_models")
    return {"clipseg": build_tiny_clipseg(root / "clipseg"),
            "background": build_tiny_background(root / "background.onnx")}


@pytest.fixture
def folder(tmp_path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(3):
        image = Image.new("RGB", (48, 32), (0, 0, 255))
        image.paste((255, 0, 0), (4, 4, 14, 14))
        image.save(folder / f"img{i}.png")
    return folder


def test_prompts_make_masks_with_a_progress_bar(models, folder, capsys):
    code = cli.main(["mask", str(folder), "--prompt", "person", "--prompt", "the dog",
                     "--model", str(models["clipseg"]), "--offline", "--device", "cpu",
                     "--batch-size", "2", "--soft"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert sorted(p.name for p in folder.glob("*_mask.png")) == [
        "img0_mask.png", "img1_mask.png", "img2_mask.png"]
    assert "3/3" in err and "loading CLIPSeg" in err  # the bar and the status lines
    assert "mask job finished: 3 image(s) done, 3 file(s) written" in out
    soft = np.asarray(Image.open(folder / "img0_mask.png"))
    assert len(np.unique(soft)) > 2  # --soft: grey levels, no threshold


def test_background_removal_options_reach_the_mask(models, folder, capsys):
    code = cli.main(["mask", str(folder), "--remove-background", "--background-model", "u2net",
                     "--model-file", str(models["background"]), "--offline", "--invert",
                     "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""  # --quiet: no bar, no status lines
    mask = np.asarray(Image.open(folder / "img1_mask.png"))
    assert mask[8, 8] == 0 and mask[20, 40] == 255  # the red subject left out (--invert)
    # Run again: the masks are there, so nothing changes without --replace.
    before = (folder / "img1_mask.png").read_bytes()
    assert cli.main(["mask", str(folder), "--remove-background", "--background-model", "u2net",
                     "--model-file", str(models["background"]), "--offline"]) == 0
    assert (folder / "img1_mask.png").read_bytes() == before
    assert "3 image(s) left alone (has a mask" in capsys.readouterr().out


@pytest.mark.parametrize("options, message", [
    (["--prompt", "dog", "--model-file", "x.onnx"], "--model-file is the background remover"),
    (["--prompt", "dog", "--threshold", "3"], "threshold: expected a number from 0 to 1"),
    (["--remove-background", "--background-model", "u3net"], "got 'u3net'"),
    (["--remove-background", "--model-file", "missing.onnx"], "missing.onnx does not exist"),
])
def test_a_refusal_is_one_line_and_exit_2(folder, capsys, options, message):
    code = cli.main(["mask", str(folder), "--offline", *options])
    err = capsys.readouterr().err
    assert code == 2 and message in err
    assert err.strip().count("\n") == 0 and err.startswith("tempera-data mask: ")
    assert not list(folder.glob("*_mask.png"))


def test_a_prompt_or_the_background_remover_is_required(folder, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["mask", str(folder)])
    assert exited.value.code == 2
    assert "one of the arguments --prompt --remove-background is required" in \
        capsys.readouterr().err
