"""What the denoiser is fed in one micro-step: latents (from the cache, or the VAE's posterior
with pre-drawn noise), the captions' conditioning, and inputs marked for varying shapes and in
the denoiser's memory layout. The training step (recipe.py) and validation's fixed batches
(validation/validation.py) encode through the same functions."""
from __future__ import annotations

import torch

from modules.config.data import shapes_vary
from modules.train.recipe.compile_guard import COMPILE_DENOISER
from modules.train.recipe.trainable import denoiser_memory_format
from modules.train.state.run import Run


def encode_latents(run: Run, batch: dict, vae_eps: torch.Tensor | None) -> torch.Tensor:
    """Latents as the denoiser sees them (the family's `vae_latents`): from the cache,
    or the VAE posterior with pre-drawn noise."""
    vae = run.bundle.vae
    if "latents" in batch:
        return batch["latents"].to(run.device, run.compute_dtype, non_blocking=True)
    pixels = varying_shape(run, batch["pixel_values"].to(run.device, vae.dtype,
                                                         non_blocking=True), "vae")
    posterior = vae.encode(pixels).latent_dist
    assert vae_eps is not None  # drawn for every batch without latents (draw_randomness)
    latents = posterior.mean + posterior.std * vae_eps.to(run.device, posterior.mean.dtype)
    return run.family.vae_latents(vae, latents).to(run.compute_dtype)


def encode_captions(run: Run, batch: dict, captions: list[str]) -> dict:
    """The denoiser's conditioning for `captions` (the batch's, after caption dropout)."""
    if run.text_cache is not None:
        embeddings = run.text_cache.encode(captions, batch.get("caption_varies"))
    else:
        embeddings = run.family.encode_text(run.bundle, captions, run.device, run.forward)
    # Text encoders may be kept at another dtype than the denoiser (a fine-tuned denoiser
    # trains at model.train_dtype while frozen encoders stay at model.weight_dtype).
    pooled = embeddings.pooled
    embeddings = embeddings._replace(
        hidden=embeddings.hidden.to(run.compute_dtype),
        pooled=None if pooled is None else pooled.to(run.compute_dtype))
    _, height, width = run.pixel_shape(batch)
    conditioning = run.family.conditioning(embeddings, batch, height, width)
    for tensor in run.family.varying_lengths(conditioning):
        run.guard.mark_varying_length(COMPILE_DENOISER, tensor)
    return conditioning


def varying_shape(run: Run, tensor: torch.Tensor, component: str) -> torch.Tensor:
    """With aspect-ratio buckets the batch's size, height and width change between batches:
    under compile.dynamic AUTO the compiled component's input is marked up front, so a whole
    denoiser or VAE does not first compile static and then recompile at the second bucket
    (modules/compile/dynamic_dims.py). `component` is the compile engine's name."""
    if not shapes_vary(run.config.data):  # aspect buckets or several resolutions
        return tensor
    return run.guard.mark_varying_input(component, tensor)


def denoiser_input(run: Run, noisy: torch.Tensor) -> torch.Tensor:
    """The noisy latents in the denoiser's memory layout (a channels-last denoiser's first
    convolution then reads them without a conversion), marked for varying shapes.

    Always that layout, whatever the latents came in: the VAE's output on the CPU can be
    channels-last while cached latents are contiguous, and compiled code is keyed on its
    inputs' strides, so a run that caches its latents would otherwise miss every graph a run
    (or compile ahead's process) that encodes them compiled. A no-op when already so."""
    noisy = noisy.contiguous(memory_format=denoiser_memory_format(run.config))
    return varying_shape(run, noisy, COMPILE_DENOISER)
