"""The training options built separately, on at once in one compiled run: a LoCon adapter,
class images with a prior-loss weight, masked loss, Huber loss with pyramid noise and input
perturbation, and validation on a held-out split. Each is tested for what it does in its own
file; this checks they compose: the run finishes, nothing recompiles after warm-up, and the
records of each are there."""
from __future__ import annotations

import json
import math

from PIL import Image

from modules.events import RecordingCallbacks
from modules.train.trainer import train


def masked_image(path, index: int) -> None:
    """A coloured square on grey, with a mask file that keeps the square."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", (64, 64), (128, 128, 128))
    image.paste((40 * index % 256, 90, 200), (16, 16, 48, 48))
    image.save(path)
    keep = Image.new("L", (64, 64), 0)
    keep.paste(255, (16, 16, 48, 48))
    keep.save(path.with_name(path.stem + "_mask.png"))
    path.with_suffix(".txt").write_text(f"sks square, colour {index}")


def class_image(path, index: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 64), (30 * index % 256, 60, 60)).save(path)


def test_the_options_compose_in_one_compiled_run(tiny_config, tmp_path):
    import torch._dynamo
    for i in range(8):
        masked_image(tmp_path / "subject" / f"{i}.png", i)
    for i in range(4):
        class_image(tmp_path / "class" / f"{i}.png", i)
    datasets = json.dumps([{"path": str(tmp_path / "subject")},
                           {"path": str(tmp_path / "class"), "regularization": True,
                            "class_caption": "a square"}])
    callbacks = RecordingCallbacks()
    torch._dynamo.reset()  # count only this run's compiles
    try:
        result = train(tiny_config(
            f"data.datasets={datasets}", "data.masked_loss=true",
            "training.prior_loss_weight=0.5", "training.adapter=LOCON", "training.conv_rank=2",
            "training.conv_alpha=2", "loss.loss_type=HUBER", "loss.multires_noise_iterations=2",
            "loss.input_perturbation=0.1", "validation.every_steps=2",
            "validation.split_ratio=0.25", "validation.timesteps=2",
            "compile.backend=AOT_EAGER", "training.max_steps=4"), callbacks)
    finally:
        torch._dynamo.reset()
    record = json.loads((result.output_dir / "run.json").read_text())
    assert result.status == "finished" and result.steps == 4
    assert all(math.isfinite(x) for x in record["losses"])
    unet = record["compile"]["unet"]
    assert unet["effective"] == "AOT_EAGER" and unet["compiled_code_ran"], unet
    assert record["batch_shapes"]["recompiles_after_first_pass"] == 0
    assert not any(e.kind == "recompile" for e in callbacks.compile_events)
    history = record["validation"]["history"]
    assert [step for step, _ in history] == [2, 4]
    assert all(math.isfinite(loss) for _, loss in history)
    assert record["validation"]["images"] == 2  # a quarter of the 8 subject images
    assert record["masked_loss"]["file"] == 6  # the 6 subject images left to train
    assert record["regularization"] is not None
