"""Sample images from the model being trained, with fixed prompts and seeds."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image

from modules.config.prompts import SamplePrompt
from modules.config.schema import Config, Sampler
from modules.models.bundle import ModelBundle
from modules.models.families import family_of
from modules.train.outputs.saving import build_pipeline
from modules.train.recipe.placement import borrowed
from modules.util.atomic import atomic_file


# sampler -> (diffusers scheduler class, the settings that make it that sampler). Built from the
# model's own scheduler config, so the noise schedule and prediction type stay the model's.
SAMPLERS: dict[Sampler, tuple[str, dict]] = {
    Sampler.DDIM: ("DDIMScheduler", {}),
    Sampler.EULER: ("EulerDiscreteScheduler", {}),
    Sampler.EULER_A: ("EulerAncestralDiscreteScheduler", {}),
    Sampler.DPMPP_2M_KARRAS: ("DPMSolverMultistepScheduler",
                              {"algorithm_type": "dpmsolver++", "solver_order": 2,
                               "use_karras_sigmas": True}),
    Sampler.UNIPC: ("UniPCMultistepScheduler", {}),
}


def sampling_scheduler(sampler: Sampler, model_scheduler_config, samplers=None):
    """The diffusers scheduler that runs `sampler` on the model's noise schedule; `samplers`:
    the family's own table (a flow-matching family's), else the DDPM samplers above."""
    import diffusers
    name, settings = (samplers or SAMPLERS)[sampler]
    return getattr(diffusers, name).from_config(model_scheduler_config, **settings)


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
def sample_images(bundle: ModelBundle, config: Config, prompts: list[SamplePrompt],
                  device: torch.device, step: int, folder: Path,
                  should_stop: Callable[[], bool] = lambda: False, text_cache=None,
                  write: bool = True) -> list[tuple[Path, str, Image.Image]]:
    """Render one image per sample prompt into `folder`; return (path, prompt, image) rows.

    Every component is put in eval mode for sampling and restored afterwards, so sampling never
    changes what training does next (each prompt has its own seeded generator). `should_stop`
    is asked between prompts and between denoising steps: when it says so, the rows written so
    far are returned (a sample cut short is not written), so a Stop waits for one denoising
    step, not the whole pass. A `text_cache` whose text encoder has left the device
    (train/recipe/text_cache.py) hands the pipeline the cached prompts instead
    (`prompt_texts`). `write=False` draws the images without writing them (an FSDP rank
    other than the main one: it takes part in every sharded forward, rank 0 writes).
    """
    modes = {name: m.training for name, m in bundle.components().items()}
    for module in bundle.components().values():
        module.eval()
    try:
        scheduler = sampling_scheduler(config.sampling.sampler, bundle.noise_scheduler.config,
                                       family_of(bundle.model_type).samplers)
        offloaded = text_cache is not None and text_cache.encoders_left()
        pipeline = build_pipeline(bundle, config, scheduler=scheduler,
                                  without_text_encoders=offloaded)
        pipeline.set_progress_bar_config(disable=True)
        # a VAE kept on the CPU (train/recipe/placement.py) decodes on the device for this
        # pass, then leaves again
        with borrowed({"vae": bundle.vae}, device):
            return _draw(pipeline, bundle, prompts, folder, step, should_stop,
                         text_cache if offloaded else None, write)
    finally:
        for name, module in bundle.components().items():
            module.train(modes[name])


def _draw(pipeline, bundle: ModelBundle, prompts: list[SamplePrompt], folder: Path, step: int,
          should_stop: Callable[[], bool], text_cache, write: bool = True
          ) -> list[tuple[Path, str, Image.Image]]:
    """Each prompt's image, written into `folder` (when `write`), until `should_stop`."""
    zeros = bool(pipeline.config.get("force_zeros_for_empty_prompt", False))
    # a pipeline that takes no negative prompt as text gets both prompts encoded here, by the
    # family, as it would encode them
    encode_here = family_of(bundle.model_type).negative_prompt_encoded_only
    rows = []
    for i, prompt in enumerate(prompts):
        if should_stop():
            break
        generator = torch.Generator("cpu").manual_seed(prompt.seed)
        try:
            image = pipeline(**prompt_texts(bundle, prompt, text_cache, zeros, encode_here),
                             height=prompt.height, width=prompt.width,
                             num_inference_steps=prompt.steps,
                             guidance_scale=prompt.guidance_scale, generator=generator,
                             callback_on_step_end=_stop_between_steps(should_stop)).images[0]
        except _SamplingStopped:
            break
        path = folder / f"step-{step:06d}-{i}.png"
        if write:
            write_sample(path, image)
        rows.append((path, prompt.text, image))
    return rows


def write_sample(path: Path, image: Image.Image) -> None:
    """One sample image as a PNG at `path`, atomically (a failed write leaves no file)."""
    with atomic_file(path) as tmp:
        image.save(tmp, format="PNG")


def prompt_texts(bundle: ModelBundle, prompt: SamplePrompt, text_cache=None,
                 zeros_for_empty: bool = False, encode_here: bool = False) -> dict:
    """The pipeline's prompt arguments: the texts, or with a `text_cache` the cached prompt
    and negative prompt as the family's pipeline takes them encoded (`encode_here`: encoded
    now by the family, for a pipeline that takes its negative prompt encoded only).
    `zeros_for_empty`: the pipeline's `force_zeros_for_empty_prompt` (SDXL's), which
    conditions an empty negative prompt on zeros rather than its encoding; the cached one
    follows it."""
    if text_cache is None and not encode_here:
        return {"prompt": prompt.text, "negative_prompt": prompt.negative or None}
    arguments = family_of(bundle.model_type).pipeline_text_arguments
    if arguments is None:
        raise ValueError(f"{bundle.model_type.value}: its pipeline takes no encoded prompts, "
                         "so its samples cannot use cached text embeddings")
    dtype = bundle.denoiser.dtype  # the cached rows are at the text encoder's dtype

    def encoded(text: str):
        # the encoder's device asked only without a cache (with one it may be released)
        rows = (text_cache.encode([text]) if text_cache is not None else
                family_of(bundle.model_type).encode_text(
                    bundle, [text],
                    next(next(iter(bundle.text_encoders.values())).parameters()).device, None))
        pooled = rows.pooled
        return rows._replace(hidden=rows.hidden.to(dtype),
                             pooled=None if pooled is None else pooled.to(dtype))
    positive = encoded(prompt.text)
    if zeros_for_empty and not prompt.negative:
        pooled = positive.pooled
        negative = positive._replace(hidden=torch.zeros_like(positive.hidden),
                                     pooled=None if pooled is None else torch.zeros_like(pooled))
    else:
        negative = encoded(prompt.negative)
    return arguments(positive, negative)
