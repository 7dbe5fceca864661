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
from modules.train.compile_guard import compile_facts
from modules.config.problems import ConfigError
from modules.config.schema import Config
from modules.config.validate import validate
from modules.models.loader import resolve_model_path, unet_conditioning
from modules.models.loader import encode_text
from modules.paths import cache_dir_for
from modules.train.builders import pick_device
from modules.train.inputs import check_inputs
from modules.train.prepare import load_bundle
from modules.train.weights import apply_unet_memory_format, unet_memory_format


def _example_inputs(bundle, config: Config, device: torch.device) -> dict[str, tuple]:
    """One realistic call per component: the UNet's noisy latents + conditioning, etc."""
    res = config.data.resolution
    factor = bundle.latent_downscale
    latents = torch.randn(1, bundle.vae.config.latent_channels, res // factor, res // factor,
                          device=device, dtype=bundle.unet.dtype).contiguous(
        memory_format=unet_memory_format(config))  # as the training step hands it over
    with torch.no_grad():
        hidden, pooled = encode_text(bundle, ["a photo"], device)
    sizes = {"original_size": [(res, res)], "crop_top_left": [(0, 0)], "target_size": [(res, res)]}
    hidden, added = unet_conditioning(hidden, pooled, sizes)
    timesteps = torch.tensor([500], device=device)
    first_encoder = next(iter(bundle.text_encoders.values()))
    ids = torch.zeros(1, 77, dtype=torch.long, device=device)
    pixels = torch.randn(1, 3, res, res, device=device, dtype=bundle.vae.dtype)
    return {
        "unet": (bundle.unet, ((latents, timesteps, hidden), {"added_cond_kwargs": added})),
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
    path = resolve_model_path(config.model.path, cache_dir_for(config.general.cache_dir))
    bundle = load_bundle(path, config)  # the loading training does (a single file included)
    for module in bundle.components().values():
        module.to(device).eval()
    apply_unet_memory_format(bundle, config)  # the layout training compiles with
    examples = _example_inputs(bundle, config, device)
    selected = {name: examples[name] for name in ("unet", "text_encoder", "vae")
                if getattr(config.compile, name)}
    return explain(config.compile, selected, compile_facts(config, detect_capabilities(device)))


def explain_text(config: Config) -> str:
    """`explain_config` as text for a terminal or a dialog."""
    result = explain_config(config)
    if not result:
        return "No component is selected for compilation (compile.unet / text_encoder / vae)."
    return format_explanation(result)
