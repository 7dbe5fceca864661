"""Sample images from the model being trained, with fixed prompts and seed."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image

from modules.config.schema import Config
from modules.models.loader import ModelBundle
from modules.train.weights import build_pipeline
from modules.util.atomic import atomic_file


class _SamplingStopped(Exception):
    """Raised from the pipeline's step callback to leave a sample between denoising steps."""


def _stop_between_steps(should_stop: Callable[[], bool]):
    """A `callback_on_step_end` that leaves the pipeline as soon as Stop is asked. Raising,
    rather than the pipeline's `interrupt` flag, also skips the VAE decode of a sample that
    would be thrown away."""
    def callback(pipeline, step: int, timestep, callback_kwargs: dict) -> dict:
        if should_stop():
            raise _SamplingStopped
        return callback_kwargs
    return callback


@torch.no_grad()
def sample_images(bundle: ModelBundle, config: Config, device: torch.device, step: int,
                  folder: Path, should_stop: Callable[[], bool] = lambda: False
                  ) -> list[tuple[Path, str, Image.Image]]:
    """Render one image per sampling prompt into `folder`; return (path, prompt, image) rows.

    Every component is put in eval mode for sampling and restored afterwards, so sampling never
    changes what training does next (the sampler uses its own seeded generator). `should_stop`
    is asked between prompts and between denoising steps: when it says so, the rows written so
    far are returned (a sample cut short is not written), so a Stop waits for one denoising
    step, not the whole pass.
    """
    from diffusers import DDIMScheduler

    modes = {name: m.training for name, m in bundle.components().items()}
    for module in bundle.components().values():
        module.eval()
    try:
        scheduler = DDIMScheduler.from_config(bundle.noise_scheduler.config)
        pipeline = build_pipeline(bundle, config, scheduler=scheduler)
        pipeline.set_progress_bar_config(disable=True)
        rows = []
        size = config.data.resolution
        for i, prompt in enumerate(config.sampling.prompts):
            if should_stop():
                break
            generator = torch.Generator("cpu").manual_seed(config.sampling.seed + i)
            try:
                image = pipeline(prompt, height=size, width=size,
                                 num_inference_steps=config.sampling.steps,
                                 guidance_scale=config.sampling.guidance_scale,
                                 generator=generator,
                                 callback_on_step_end=_stop_between_steps(should_stop)).images[0]
            except _SamplingStopped:
                break
            path = folder / f"step-{step:06d}-{i}.png"
            with atomic_file(path) as tmp:
                image.save(tmp, format="PNG")
            rows.append((path, prompt, image))
        return rows
    finally:
        for name, module in bundle.components().items():
            module.train(modes[name])
