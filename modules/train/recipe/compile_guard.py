"""The trainer's side of compilation: the run's compile facts, its plans, and the engine.

The engine compiles what `compile.*` selects, guards every training micro-step against lazy
compile failures (falling back one backend at a time), and reports per component for run.json.
What the plan depends on beyond `compile.*` (the machine; how each component is trained:
checkpointing decides whether CUDA graphs can stay on) is derived from the config here, in
`compile_facts`, and every front end asks the same `compile_plans`: training, Check compilation
(`explain_run.py`), the GUI's summary line and the benchmark.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from modules.compile import (Capabilities, CompileEngine, CompileFacts, CompilePlan,
                             ComponentTraining, build_plan, compile_cache_folder,
                             detect_capabilities)
from modules.compile.backends import BACKENDS
from modules.compile.bundle import (BundleKeeper, Fingerprint, Lookup, find_bundle,
                                    settings_hash)
from modules.compile.shape_sets import CompileCost, Shape, compile_cost, possible_shapes
from modules.config.schema import CompileScope, Config
from modules.model_types import MODEL_TYPES
from modules.events import TrainerCallbacks
from modules.compile.regions import REPEATED_BLOCKS
from modules.models.bundle import ModelBundle
from modules.train.recipe.builders import pick_device
from modules.train.recipe.trainable import trained_components
from modules.models.families import family_of
from modules.train.recipe.compile_scope import bundle_folder, planned_config

# The compile engine's (and run.json's) name for the denoiser, whatever its family calls it:
# `compile.denoiser` selects it.
COMPILE_DENOISER = "unet"


def component_training(config: Config, trained: list[str]) -> dict[str, ComponentTraining]:
    """Per compile component, how this run trains it (text encoders count as one component)."""
    t = config.training

    def how(is_trained: bool) -> ComponentTraining:
        return ComponentTraining(trained=is_trained,
                                 gradient_checkpointing=is_trained and t.gradient_checkpointing,
                                 accumulation=t.gradient_accumulation)

    denoiser = MODEL_TYPES[config.model.type].denoiser
    return {COMPILE_DENOISER: how(denoiser in trained),
            "text_encoder": how(any(n.startswith("text_encoder") for n in trained)),
            "vae": how(False)}


def compile_facts(config: Config, capabilities: Capabilities,
                  trained: list[str] | None = None) -> CompileFacts:
    """What the compile plan needs to know about this run besides `compile.*`: the machine
    (``capabilities``) and how each component is trained (``trained``: default, the config's)."""
    if trained is None:
        trained = trained_components(config)
    return CompileFacts(capabilities, component_training(config, trained))


def machine_capabilities(config: Config) -> Capabilities:
    """What the device the config trains on can compile with (detected: imports triton)."""
    return detect_capabilities(pick_device(config.general.device))


def compile_plans(config: Config,
                  capabilities: Capabilities | None = None) -> dict[str, CompilePlan]:
    """Per component, what training this config will compile, with what, and why: the plan the
    run applies (``capabilities``: default, this machine's for the configured device)."""
    caps = capabilities if capabilities is not None else machine_capabilities(config)
    config = planned_config(config)  # AUTO: what it decided before, else REGIONAL
    return build_plan(config.compile, compile_facts(config, caps))


def component_blocks(bundle: ModelBundle) -> dict[str, tuple[str, ...]]:
    """Per bundle component (its own name: "unet", "text_encoder_2"), the class names of the
    repeated blocks REGIONAL compiles: what FSDP shards one by one (train/recipe/distributed.py)."""
    blocks = {bundle.denoiser_name: family_of(bundle.model_type).repeated_blocks}
    for name in bundle.text_encoders:
        blocks[name] = REPEATED_BLOCKS["text_encoder"]
    return blocks


def compile_fingerprint(config: Config, facts: CompileFacts,
                        device: torch.device | str) -> Fingerprint:
    """What this run's compiled code is made for (a compile bundle's fingerprint): the
    software and device, the family, each compiled component's settings, the dtypes and the
    batch shapes the config allows."""
    plans = build_plan(config.compile, facts)
    caps = facts.capabilities
    device = torch.device(device)  # a name ("cpu") is taken too, as the engine takes it
    triton = ""
    if caps.triton_ok:
        from importlib.metadata import PackageNotFoundError, version
        try:
            triton = version("triton")
        except PackageNotFoundError:  # a machine faked by a test, or Triton by another name
            triton = "unknown"
    def settings(plan: CompilePlan) -> str:
        return settings_hash({"kwargs": plan.torch_compile_kwargs,
                              "options": plan.inductor_options,
                              "dynamic": config.compile.dynamic.value})

    components = tuple(f"{name}: {plan.effective.value} {config.compile.scope.value} "
                       f"{settings(plan)}" for name, plan in plans.items() if plan.compiled)
    shapes = possible_shapes(config.data, config.training.batch_size)
    return Fingerprint(
        torch=torch.__version__, triton=triton, cuda=torch.version.cuda or "",
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        capability=".".join(map(str, caps.compute_capability or ())),
        # inductor's CPU code is generated for torch's thread count (part of its cache key):
        # a bundle from a process with another count would load and serve nothing
        threads=str(torch.get_num_threads()) if device.type == "cpu" else "",
        family=config.model.type.value, components=components,
        dtype=f"{config.model.weight_dtype.value} {config.model.weight_storage.value} "
              f"{config.training.mixed_precision.value}",
        shapes=tuple(sorted({"x".join(map(str, s)) for listed in shapes.values()
                             for s in listed})))


def bundle_places(config: Config) -> list[Path]:
    """Where a run looks for its compile bundle, in order: compile.bundle (a file or a
    folder), then the cache folder's bundles/."""
    named = [Path(config.compile.bundle).expanduser()] if config.compile.bundle else []
    return [*named, bundle_folder(config)]


def bundle_keeper(config: Config, facts: CompileFacts, device: torch.device | str,
                  write: bool, ahead: Path | None = None) -> BundleKeeper | None:
    """The run's compile bundles (compile.bundles), written by the main process; ``ahead``
    is the bundle this run's compile-ahead process wrote (compile.ahead), if any."""
    if not config.compile.bundles:
        return None
    return BundleKeeper(compile_fingerprint(config, facts, device), bundle_places(config),
                        bundle_folder(config), write=write, ahead=ahead)


def matching_bundle(config: Config, capabilities: Capabilities | None = None) -> Lookup | None:
    """What a run of ``config`` would find of its compile bundle here (the GUI's line), or
    None when bundles are off or nothing is compiled with inductor."""
    caps = capabilities if capabilities is not None else machine_capabilities(config)
    config = planned_config(config)  # AUTO: what it decided before, else REGIONAL
    facts = compile_facts(config, caps)
    plans = build_plan(config.compile, facts)
    if not config.compile.bundles or not any(
            p.compiled and BACKENDS[p.effective].inductor for p in plans.values()):
        return None
    device = pick_device(config.general.device)
    return find_bundle(compile_fingerprint(config, facts, device), bundle_places(config))


def build_compile_guard(config: Config, bundle: ModelBundle, device: torch.device,
                        params: dict, trained: list[str],
                        callbacks: TrainerCallbacks, writes_bundle: bool = True,
                        ahead_bundle: Path | None = None) -> CompileEngine:
    """Compile the selected components in place and return the engine that guards each step.
    REGIONAL compiles the denoiser's repeated blocks that its family names. ``writes_bundle``:
    this process writes the run's compile bundle (the main one of a multi-process run);
    ``ahead_bundle``: the one compiled ahead for this run (compile.ahead)."""
    # a run has decided AUTO before it gets here (recipe.py); any other caller compiles what
    # the plan shows: the stored decision, else REGIONAL
    config = planned_config(config, device)
    facts = compile_facts(config, detect_capabilities(device), trained)
    cache_dir = compile_cache_folder(config.compile.cache_dir, config.general.cache_dir)
    engine = CompileEngine(
        config.compile,
        {COMPILE_DENOISER: bundle.denoiser, "text_encoder": list(bundle.text_encoders.values()),
         "vae": bundle.vae},
        regional_blocks={**REPEATED_BLOCKS, COMPILE_DENOISER: family_of(bundle.model_type).repeated_blocks},
        callbacks=callbacks, device=device, capabilities=facts.capabilities,
        trainable_params=[p for plist in params.values() for p in plist],
        training=facts.training, cache_dir=cache_dir,
        bundles=bundle_keeper(config, facts, device, writes_bundle, ahead_bundle))
    try:
        engine.apply()
    except BaseException:  # what apply changed so far (cache folders, callbacks) put back
        engine.close()
        raise
    return engine


def denoiser_compile_cost(config: Config,
                          shapes_per_resolution: Mapping[int, Sequence[Shape]] | None = None,
                          capabilities: Capabilities | None = None) -> CompileCost | None:
    """What the run's batch shapes cost the compiled denoiser, in both scopes
    (modules/compile/shape_sets.py); None when the denoiser is not compiled.
    `shapes_per_resolution` is what a scan found (`--check`, the run); without it, the most
    the config allows (the GUI, before any image is read)."""
    caps = capabilities if capabilities is not None else machine_capabilities(config)
    config = planned_config(config)  # AUTO: what it decided before, else REGIONAL
    full = dataclasses.replace(config, compile=dataclasses.replace(config.compile,
                                                                   scope=CompileScope.FULL))
    plan = compile_plans(full, caps)[COMPILE_DENOISER]
    if not plan.compiled:
        return None
    if shapes_per_resolution is None:  # the most the config allows
        return compile_cost(possible_shapes(config.data, config.training.batch_size),
                            config.compile.dynamic, plan, upper_bound=True)
    return compile_cost(shapes_per_resolution, config.compile.dynamic, plan)
