"""Tiny mask makers built here, so the mask job's tests need no download: a random-weight
CLIPSeg (with a CLIP tokenizer trained on the tiny corpus, as the tiny SD's is) and a small
ONNX background remover of U^2-Net's interface (rembg's `u2net` session reads it).

The background remover is a real two-layer convolutional network, not random: it keeps red
pixels (a 1x1 convolution on the red channel after rembg's normalisation, then a sigmoid), so a
test can say where its mask must be white.
"""
from __future__ import annotations

from pathlib import Path

TINY_CLIPSEG_IMAGE = 32  # the tiny CLIPSeg's input side (the real one reads 352)


def build_tiny_clipseg(dest: Path, seed: int = 0) -> Path:
    """Save a random-weight CLIPSeg and its processor into `dest`; returns `dest`."""
    import torch
    from transformers import (CLIPSegConfig, CLIPSegForImageSegmentation, CLIPSegProcessor,
                              ViTImageProcessor)

    from modules.models.tiny_sd import build_clip_tokenizer

    tokenizer = build_clip_tokenizer(dest, vocab_size=600)
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=TINY_CLIPSEG_IMAGE, patch_size=8)
    config = CLIPSegConfig(text_config=text, vision_config=vision, projection_dim=16,
                           extract_layers=[0, 1], reduce_dim=16, decoder_num_attention_heads=2,
                           decoder_intermediate_size=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIPSegForImageSegmentation(config).eval()
    model.save_pretrained(dest)
    # CLIPSeg's own preprocessing (ImageNet mean and std, a square resize), at the tiny size.
    images = ViTImageProcessor(do_resize=True, size={"height": TINY_CLIPSEG_IMAGE,
                                                     "width": TINY_CLIPSEG_IMAGE},
                               image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    CLIPSegProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(dest)
    return dest


def build_tiny_background(dest: Path) -> Path:
    """Write a small ONNX network with U^2-Net's interface (1x3x320x320 in, 1x1x320x320 out)
    that keeps red pixels; returns the file."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    side = 320
    # After rembg's normalisation (x / max - mean) / std, pure red is about (2.2, -2.0, -1.8)
    # and pure blue (-2.1, -2.0, 2.6): red minus blue separates them.
    pick = numpy_helper.from_array(np.array([1.0, 0.0, -1.0], np.float32).reshape(1, 3, 1, 1),
                                   "pick")
    scale = numpy_helper.from_array(np.array([3.0], np.float32), "scale")
    smooth = numpy_helper.from_array(np.full((1, 1, 3, 3), 1.0 / 9.0, np.float32), "smooth")
    nodes = [helper.make_node("Conv", ["input.1", "pick"], ["redness"]),
             helper.make_node("Conv", ["redness", "smooth"], ["smoothed"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["smoothed", "scale"], ["scaled"]),
             helper.make_node("Sigmoid", ["scaled"], ["mask"])]
    graph = helper.make_graph(
        nodes, "tiny_background",
        [helper.make_tensor_value_info("input.1", TensorProto.FLOAT, [1, 3, side, side])],
        [helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, side, side])],
        initializer=[pick, scale, smooth])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # an IR every onnxruntime of the last years reads
    onnx.checker.check_model(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, dest)
    return dest
