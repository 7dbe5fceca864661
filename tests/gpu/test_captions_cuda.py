"""Captioning on the GPU (modules/data/prep/caption.py): the tiny Florence-2 and Qwen3-VL run
in bfloat16 / float16 on CUDA, and the job gives the memory back when it ends (a training run
started next finds the card as it was)."""
from __future__ import annotations

import pytest
import torch
from PIL import Image

from modules.data.prep.caption import caption_folder, preset_settings, read_caption

from tests.data.prep.tiny_captioners import build_tiny_florence2, build_tiny_qwen_vl


@pytest.mark.parametrize("captioner, build, prompt", [
    ("florence2", build_tiny_florence2, "<DETAILED_CAPTION>"),
    ("qwen-vl", build_tiny_qwen_vl, "Describe the image."),
])
def test_captions_on_the_gpu_and_the_memory_is_given_back(tmp_path, captioner, build, prompt):
    model = build(tmp_path / captioner)
    folder = tmp_path / "images"
    folder.mkdir()
    for i, colour in enumerate([(230, 20, 20), (20, 230, 20), (20, 20, 230)]):
        Image.new("RGB", (40, 28), colour).save(folder / f"{i}.png")
    before = torch.cuda.memory_allocated()
    said: list[str] = []
    from modules.data.prep.job import JobHooks
    report = caption_folder(folder, preset_settings(None, captioner=captioner, model=str(model),
                                                    prompt=prompt, device="auto", max_tokens=8,
                                                    batch_size=2), JobHooks(status=said.append))
    assert report.status == "finished" and not report.failed, report.lines()
    assert any("on the GPU" in line for line in said)
    assert all(read_caption(folder / f"{i}.txt") for i in range(3))
    assert torch.cuda.memory_allocated() == before
