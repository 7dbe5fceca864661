"""A random LoRA on the tiny SD 1.5's UNet, written by the trainer's own kohya saver: the input
the LoRA tools' command-line and window tests share."""
from __future__ import annotations

from pathlib import Path

import torch

from modules.config.schema import ModelType


def random_unet_lora(base: Path, path: Path) -> Path:
    """A kohya LoRA (rank 4, alpha 8) on the attention q and v of the UNet of `base` (a tiny
    SD 1.5 folder), its factors random (seed 0, both non-zero: a real update)."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    from modules.models.kohya import save_kohya_lora
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet")
    unet.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"]))
    generator = torch.Generator().manual_seed(0)
    for key, param in unet.named_parameters():
        if "lora_" in key:
            param.data = torch.randn(param.shape, generator=generator) * 0.1
    return save_kohya_lora({"unet": unet}, path, 8.0, ModelType.SD15)
