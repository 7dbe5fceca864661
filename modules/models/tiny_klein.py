"""A tiny, randomly initialised Flux.2 Klein, built locally: the same classes, folder layout
and conditioning as the real base models (diffusers' Flux2Transformer2DModel with double- and
single-stream blocks, a Qwen3 causal LM read at hidden layers 9, 18 and 27 through its chat
template, the 32-channel AutoencoderKLFlux2 with its batch-norm latent statistics, the
flow-matching Euler scheduler), a few hundred thousand parameters.

The text encoder has 28 layers, thin ones: Flux2KleinPipeline reads hidden states 9, 18 and 27
whatever the model (its `text_encoder_out_layers` default), so the tiny model is read exactly as
the real one is, with layer 27 an inner layer as it is in Qwen3-4B's 36. Weights are seeded
and the tokenizer is trained here (modules/models/tiny_text.py), so a build is repeatable and
needs no download.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

TEXT_WIDTH = 16       # the tiny Qwen3's hidden size
TEXT_LAYERS = 28      # hidden_states[27] exists and is not the last (normed) one
KLEIN_TEXT_LAYERS = (9, 18, 27)  # what Flux2KleinPipeline stacks (its default)
TINY_KLEIN: dict[str, Any] = {
    # 2 double-stream and 2 single-stream blocks (the 4B has 5 and 20); head_dim 16 =
    # sum(axes_dims_rope), the 4-axis RoPE of (time, height, width, caption position);
    # captions arrive as three stacked hidden layers: 3 x TEXT_WIDTH features
    "transformer": {"patch_size": 1, "in_channels": 128, "num_layers": 2,
                    "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                    "joint_attention_dim": len(KLEIN_TEXT_LAYERS) * TEXT_WIDTH,
                    "timestep_guidance_channels": 32, "mlp_ratio": 3.0,
                    "axes_dims_rope": [4, 4, 4, 4], "rope_theta": 2000, "eps": 1e-6,
                    "guidance_embeds": False},
    "text_encoder": {"hidden_size": TEXT_WIDTH, "intermediate_size": 32,
                     "num_hidden_layers": TEXT_LAYERS, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 1024,
                     "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                     "tie_word_embeddings": True},
    # Flux.2's VAE in miniature: 32 latent channels, 8x down, quant convs, 2x2 patches whose
    # 128 channels are normalised by the batch norm's running statistics (set below)
    "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 32, "sample_size": 64,
            "block_out_channels": (8, 16, 32, 32), "layers_per_block": 1,
            "norm_num_groups": 4, "down_block_types": ("DownEncoderBlock2D",) * 4,
            "up_block_types": ("UpDecoderBlock2D",) * 4, "mid_block_add_attention": True},
    # the base models' scheduler: Flux2KleinPipeline passes mu (its empirical, resolution- and
    # step-dependent shift) to it at every sampling
    "scheduler": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
                  "base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5,
                  "max_shift": 1.15, "time_shift_type": "exponential"},
    "tokenizer_vocab_size": 600,
}


def _seeded(seed: int, build) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def _with_latent_statistics(vae: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give the VAE's batch norm running statistics other than 0 and 1 (a fresh BatchNorm's),
    as the released VAE has: the normalisation the pipeline applies then shows in the tests."""
    generator = torch.Generator().manual_seed(seed)
    bn: Any = vae.bn
    channels = bn.running_mean.shape[0]
    bn.running_mean.copy_(torch.randn(channels, generator=generator) * 0.2)
    bn.running_var.copy_(torch.rand(channels, generator=generator) * 1.5 + 0.25)
    return vae


def build_tiny_klein(dest: Path, seed: int = 0, spec: dict[str, Any] | None = None,
                     dtype: torch.dtype | None = None) -> Path:
    """Build the tiny Klein (or a random-weight one of another `spec` laid out as TINY_KLEIN:
    the GPU validation's real-size one) and save it as a `Flux2KleinPipeline` folder in `dest`,
    its text encoder a Qwen3ForCausalLM as in the released folders; `dtype`: each component
    cast to it as soon as it is built (the 4B's transformer is 16 GB in float32)."""
    import diffusers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from modules.models.tiny_text import CORPUS_PATH, build_qwen_tokenizer

    spec = spec or TINY_KLEIN

    def built(seed: int, build) -> torch.nn.Module:
        module = _seeded(seed, build)
        return module.to(dtype) if dtype is not None else module
    with tempfile.TemporaryDirectory(prefix="tempera-qwen-tokenizer-") as work:
        tokenizer = build_qwen_tokenizer(Path(work) / "tokenizer",
                                         spec["tokenizer_vocab_size"], CORPUS_PATH)
        text_config = Qwen3Config(**spec["text_encoder"], vocab_size=len(tokenizer),
                                  pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
        # the statistics set in float32, then cast with the rest
        vae = _with_latent_statistics(
            _seeded(seed + 1, lambda: diffusers.AutoencoderKLFlux2(**spec["vae"])), seed + 3)
        pipeline = diffusers.Flux2KleinPipeline(
            transformer=built(seed, lambda: diffusers.Flux2Transformer2DModel(
                **spec["transformer"])),
            vae=vae.to(dtype) if dtype is not None else vae,
            text_encoder=built(seed + 2, lambda: Qwen3ForCausalLM(text_config)),
            tokenizer=tokenizer,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**spec["scheduler"]))
        pipeline.save_pretrained(dest, safe_serialization=True)
    return Path(dest)


def real_size_spec() -> dict[str, Any]:
    """Klein 4B at its real size from the shipped configs (modules/models/configs/klein4b), in
    the layout of the tiny one: the 4 B transformer (5 double- and 20 single-stream blocks),
    Qwen3-4B, Flux.2's VAE. The tokenizer is trained here as for the tiny model (600 tokens,
    not Qwen's 151,936: the embedding table is 0.7 GiB smaller in bf16; the encoder leaves the
    GPU once the captions are cached)."""
    from modules.models.shipped_configs import real_component_config, shipped_scheduler
    spec: dict[str, Any] = {part: real_component_config("klein4b", part)[0]
                            for part in ("transformer", "text_encoder", "vae")}
    spec["scheduler"] = shipped_scheduler("klein4b")
    return {**spec, "tokenizer_vocab_size": TINY_KLEIN["tokenizer_vocab_size"]}


def build_real_size(spec: dict[str, Any], dest: Path) -> Path:
    """A random-weight Klein of `spec`, saved in bf16 as Klein is released."""
    return build_tiny_klein(dest, spec=spec, dtype=torch.bfloat16)


def transformer_parameters(spec: dict[str, Any]) -> int:
    """Parameters of the spec's transformer (built on the meta device)."""
    import diffusers
    with torch.device("meta"):
        transformer = diffusers.Flux2Transformer2DModel(**spec["transformer"])
    return sum(p.numel() for p in transformer.parameters())
