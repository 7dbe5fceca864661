"""Configs of the CUDA checks that a CPU test also holds the compile plan to.

A GPU is lent rarely, so a change that would quietly turn a check's point off (CUDA graphs, say)
must fail on the CPU first: tests/compile/test_gpu_scenarios_plan.py asks the real plan about
the very configs built here, and the CUDA tests train them.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PIL import Image

from modules.config import Config

CUDA = ("general.device=CUDA",)


def bucket_images(folder: Path) -> Path:
    """Two wide, two square, two tall images: three buckets at resolution 256."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate([(120, 60), (120, 60), (64, 64), (64, 64), (60, 120), (60, 120)]):
        Image.effect_noise(size, 30 + i).convert("RGB").save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a noisy picture number {i}")
    return folder


def buckets(folder: Path) -> tuple[str, ...]:
    return (f"data.datasets[0].path={folder}", "data.resolution=256", "data.aspect_buckets=true")


def cudagraphs_through_three_buckets(tiny_config: Callable[..., Config], data: Path) -> Config:
    """TRITON (inductor with CUDA graphs) for three epochs over `bucket_images`' three buckets,
    with gradient accumulation and checkpointing.

    FULL scope, because that is where CUDA graphs survive checkpointing: in REGIONAL scope the
    plan turns them off (pytorch#154306, plan.cudagraph_rules), which would leave nothing of
    CUDA graphs to test. Accumulation keeps the persistent-gradient path (pytorch#169545) in.
    """
    return tiny_config(*CUDA, *buckets(data), "training.epochs=3", "training.max_steps=0",
                       "training.gradient_accumulation=2", "training.gradient_checkpointing=true",
                       "compile.backend=TRITON", "compile.scope=FULL")


def assert_unet_keeps_cudagraphs(unet: dict) -> None:
    """The UNet's compile report (run.json `compile.unet`) says TRITON ran with CUDA graphs."""
    assert (unet["requested"], unet["effective"]) == ("TRITON", "TRITON"), unet
    assert unet["scope"] == "FULL", unet
    assert unet["cudagraphs"] is True, unet["degraded"]
    assert unet["persistent_grads"] is True, unet  # accumulation under CUDA graphs
