"""Explain what compiling a config's components would do, without training.

`scripts/explain_compile.py` and the GUI's "Check compilation" button both call
`explain_config`: it loads the model the config names, builds one example input per selected
component at the config's resolution, and asks dynamo for graphs and graph breaks. The plan it
shows is the one training applies: `build_plan` with the run's facts (`compile_facts`: the
device, and how each component is trained, which decides CUDA graphs).
"""
from __future__ import annotations

from typing import Any

import torch

from modules.compile import detect_capabilities
from modules.compile.explain import explain, format_explanation
from modules.compile.regions import REPEATED_BLOCKS
from modules.config.data import shapes_vary
from modules.train.recipe.compile_scope import planned_config
from modules.train.recipe.compile_guard import compile_facts, denoiser_compile_cost
from modules.config.problems import ConfigError
from modules.config.schema import Config
from modules.config.validate import validate
from modules.models.families import family_of
from modules.models.loader import load_bundle, resolve_model_path
from modules.paths import cache_dir_for
from modules.train.recipe.builders import pick_device
from modules.train.setup.inputs import check_inputs
from modules.train.recipe.compile_guard import COMPILE_DENOISER
from modules.train.recipe.trainable import (apply_denoiser_memory_format, apply_weight_storage,
                                            component_dtypes, denoiser_memory_format)


def _example_inputs(bundle, config: Config, device: torch.device) -> dict[str, tuple]:
    """One realistic call per component: the denoiser's noisy latents + conditioning, etc."""
    res = config.data.resolution
    factor = bundle.latent_downscale
    latents = torch.randn(1, bundle.vae.config.latent_channels, res // factor, res // factor,
                          device=device, dtype=bundle.denoiser.dtype).contiguous(
        memory_format=denoiser_memory_format(config))  # as the training step hands it over
    family = family_of(bundle.model_type)
    with torch.no_grad():
        embeddings = family.encode_text(bundle, ["a photo"], device, None)
    batch = {"caption": ["a photo"], "original_size": torch.tensor([[res, res]]),
             "crop_top_left": torch.tensor([[0, 0]])}
    conditioning = family.conditioning(embeddings, batch, res, res)
    timesteps = torch.tensor([500], device=device)
    first_encoder = next(iter(bundle.text_encoders.values()))
    ids = torch.zeros(1, 77, dtype=torch.long, device=device)
    pixels = torch.randn(1, 3, res, res, device=device, dtype=bundle.vae.dtype)
    return {
        COMPILE_DENOISER: (bundle.denoiser,
                           family.denoiser_arguments(latents, timesteps, conditioning)),
        "text_encoder": (first_encoder, ((ids,), {})),
        "vae": (bundle.vae.encoder, ((pixels,), {})),
    }


def explain_config(config: Config) -> dict[str, Any]:
    """Per selected component: the plan, the capability decision, graphs and graph breaks."""
    problems = [p for p in validate(config) + check_inputs(config)
                if p.path.startswith(("model.", "compile.", "components."))]
    if problems:
        raise ConfigError(problems)
    device = pick_device(config.general.device)
    # compile.scope=AUTO: what it decided before for this setting, else REGIONAL (as training)
    config = planned_config(config, device)
    path = resolve_model_path(config.model.path, cache_dir_for(config.general.cache_dir))
    # the loading training does (a single file included)
    bundle = load_bundle(path, config.model, component_dtypes(config))
    apply_weight_storage(bundle, config)  # float8 layers, as training stores them
    for module in bundle.components().values():
        # transformers' PreTrainedModel.to is @wraps(nn.Module.to): typeshed's _Wrapped keeps
        # the unbound signature, so mypy reads `device` as `self`
        module.to(device).eval()  # type: ignore[arg-type]  # see above
    apply_denoiser_memory_format(bundle, config)  # the layout training compiles with
    examples = _example_inputs(bundle, config, device)
    wanted = {COMPILE_DENOISER: config.compile.denoiser,
              "text_encoder": config.compile.text_encoder, "vae": config.compile.vae}
    selected = {name: example for name, example in examples.items() if wanted[name]}
    # REGIONAL explains the blocks training compiles: the family's for the denoiser
    blocks = {**REPEATED_BLOCKS, COMPILE_DENOISER: family_of(bundle.model_type).repeated_blocks}
    return explain(config.compile, selected, compile_facts(config, detect_capabilities(device)),
                   blocks)


def explain_text(config: Config) -> str:
    """`explain_config` as text for a terminal or a dialog; with several resolutions or aspect
    buckets, what their shape sets cost the denoiser at most (the example input traced is one
    `data.resolution` square)."""
    result = explain_config(config)
    if not result:
        return "No component is selected for compilation (compile.denoiser / text_encoder / vae)."
    text = format_explanation(result)
    cost = denoiser_compile_cost(config) if shapes_vary(config.data) else None
    return text if cost is None else f"{text}\n{cost.describe()}"
