"""A tiny, randomly initialised Z-Image, built locally: the same classes, folder layout and
conditioning as the real one (diffusers' ZImageTransformer2DModel, a Qwen3 text encoder read at
its second-to-last layer, a 16-channel AutoencoderKL shaped like Flux.1's VAE with its shift
and scaling factors, FlowMatchEulerDiscreteScheduler), a few hundred thousand parameters.

Weights are seeded and the tokenizer is trained here (modules/models/tiny_text.py), so a build
is byte-for-byte repeatable and needs no download.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

TEXT_WIDTH = 32  # the tiny Qwen3's hidden size, which the transformer's caption features take
TINY_ZIMAGE: dict[str, Any] = {
    # n_layers main blocks and n_refiner_layers of each refiner, as the real model (30 and 2)
    # has them; head_dim 8 = sum(axes_dims), the 3-axis RoPE of (caption/frame, height, width)
    "transformer": {"all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16,
                    "dim": 32, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 4,
                    "n_kv_heads": 4, "norm_eps": 1e-5, "qk_norm": True,
                    "cap_feat_dim": TEXT_WIDTH, "rope_theta": 256.0, "t_scale": 1000.0,
                    "axes_dims": [4, 2, 2], "axes_lens": [1536, 64, 64]},
    # Qwen3 read at hidden_states[-2]: two layers at least
    "text_encoder": {"hidden_size": TEXT_WIDTH, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                     "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
                     "rope_theta": 1_000_000.0, "tie_word_embeddings": True},
    # Flux.1's VAE in miniature: 16 latent channels, 8x down, no quant convs, shift + scale
    "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "sample_size": 64,
            "block_out_channels": (8, 16, 32, 32), "layers_per_block": 1, "norm_num_groups": 4,
            "down_block_types": ("DownEncoderBlock2D",) * 4,
            "up_block_types": ("UpDecoderBlock2D",) * 4, "mid_block_add_attention": True,
            "use_quant_conv": False, "use_post_quant_conv": False, "force_upcast": True,
            "scaling_factor": 0.3611, "shift_factor": 0.1159},
    # Z-Image Base's scheduler (Turbo's says shift 3.0)
    "scheduler": {"num_train_timesteps": 1000, "shift": 6.0, "use_dynamic_shifting": False},
    "tokenizer_vocab_size": 600,
}


def _seeded(seed: int, build) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def build_tiny_zimage(dest: Path, seed: int = 0, corpus_path: Path | None = None,
                      spec: dict[str, Any] | None = None,
                      dtype: torch.dtype | None = None) -> Path:
    """Build the tiny Z-Image (or a random-weight one of another `spec`, laid out as
    TINY_ZIMAGE: the GPU validation's real-size one) and save it as a `ZImagePipeline` folder
    in `dest`; `dtype`: each component cast to it as soon as it is built (a real-size
    transformer is 24 GB in float32)."""
    import diffusers
    from transformers import Qwen3Config, Qwen3Model

    from modules.models.tiny_text import CORPUS_PATH, build_qwen_tokenizer

    corpus_path = corpus_path or CORPUS_PATH
    spec = spec or TINY_ZIMAGE

    def built(seed: int, build) -> torch.nn.Module:
        module = _seeded(seed, build)
        return module.to(dtype) if dtype is not None else module
    with tempfile.TemporaryDirectory(prefix="tempera-qwen-tokenizer-") as work:
        tokenizer = build_qwen_tokenizer(Path(work) / "tokenizer",
                                         spec["tokenizer_vocab_size"], corpus_path)
        text_config = Qwen3Config(**spec["text_encoder"], vocab_size=len(tokenizer),
                                  pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
        pipeline = diffusers.ZImagePipeline(
            transformer=built(seed, lambda: diffusers.ZImageTransformer2DModel(
                **spec["transformer"])),
            vae=built(seed + 1, lambda: diffusers.AutoencoderKL(**spec["vae"])),
            text_encoder=built(seed + 2, lambda: Qwen3Model(text_config)),
            tokenizer=tokenizer,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**spec["scheduler"]))
        pipeline.save_pretrained(dest, safe_serialization=True)
    return Path(dest)


def real_size_spec() -> dict[str, Any]:
    """Z-Image at its real size from the shipped configs, in the layout of the tiny one: the
    6 B transformer, Qwen3-4B, Flux's VAE. The tokenizer is trained here as for the tiny model
    (600 tokens, not Qwen's 151,936: the embedding table is 0.7 GiB smaller in bf16; the
    encoder leaves the GPU once the captions are cached)."""
    from modules.models.shipped_configs import real_component_config, shipped_scheduler
    spec: dict[str, Any] = {part: real_component_config("zimage", part)[0]
                            for part in ("transformer", "text_encoder", "vae")}
    spec["scheduler"] = shipped_scheduler("zimage")
    return {**spec, "tokenizer_vocab_size": TINY_ZIMAGE["tokenizer_vocab_size"]}


def build_real_size(spec: dict[str, Any], dest: Path) -> Path:
    """A random-weight Z-Image of `spec`, saved in bf16 as Z-Image is released."""
    return build_tiny_zimage(dest, spec=spec, dtype=torch.bfloat16)


def transformer_parameters(spec: dict[str, Any]) -> int:
    """Parameters of the spec's transformer (built on the meta device)."""
    import diffusers
    with torch.device("meta"):
        transformer = diffusers.ZImageTransformer2DModel(**spec["transformer"])
    return sum(p.numel() for p in transformer.parameters())
