"""Field states that follow the config: the components a model type lacks are greyed, so are
the settings the config leaves unused (modules/config/field_rules.py), each with its reason,
a setting the model type allows one value of takes it, and the two cache folders say where
they are when left empty."""
from __future__ import annotations

from enum import Enum

from app.binding import ConfigBinding, enum_class, format_value
from app.fields import container_labels
from app.form import FieldRegistry
from app.labels import enum_label
from app.widgets import BoolView, EnumView, set_label_enabled
from modules.config import Config
from modules.frontend import (MODEL_TYPES, RULED_PATHS, cache_dir_for, compile_cache_folder,
                              only_values, storage_summaries, unused_fields)


def update_cache_hints(registry: FieldRegistry, config: Config) -> None:
    """Where the two cache folders are when left empty (one lies inside the other)."""
    general = registry.view("general.cache_dir")
    compile_view = registry.view("compile.cache_dir")
    general.set_hint("" if config.general.cache_dir else
                     f"empty: {cache_dir_for('')}")
    compile_view.set_hint("" if config.compile.cache_dir else
                          f"empty: {compile_cache_folder('', config.general.cache_dir)} "
                          "(inside General's cache folder)")


LEVER_PATHS = (None, "general.device")  # what changes the storages' summaries


def update_storage_hint(registry: FieldRegistry, config: Config) -> None:
    """The 8-bit storages under *Frozen weights storage*, one line each (the hint line shows
    them elided, its tooltip in full): what each saves and costs, or why this machine cannot
    run it (FLOAT8 below sm_89). Needs the engine (torch): called once it is loaded."""
    registry.view("model.weight_storage").set_hint(" | ".join(storage_summaries(config)))


def update_component_states(registry: FieldRegistry, config: Config) -> None:
    """Grey the settings of components the model type does not have, and say which types
    have them (e.g. "Text encoder 2 (Stable Diffusion XL only)"); the denoiser is named as the
    family calls it ("UNet", "Transformer"), in its section and in the compile checkbox, and
    the sampler menu offers the family's samplers."""
    model_type = MODEL_TYPES[config.model.type]
    compile_toggle = registry.find("compile.denoiser")
    if isinstance(compile_toggle, BoolView) and compile_toggle.style == "checkbox":
        compile_toggle.toggle.configure(text=model_type.denoiser_label)
    sampler = registry.find("sampling.sampler")
    if isinstance(sampler, EnumView):  # a flow-matching family samples with its own only
        sampler.menu.configure(values=[enum_label(m) for m in enum_class(sampler.info)
                                       if model_type.samplers is None
                                       or m.value in model_type.samplers])
    for container, label in container_labels(Config).items():
        if not container.startswith("components."):
            continue
        component = container.split(".", 1)[1]
        if component == "denoiser":
            label = model_type.denoiser_label
        enabled = component in model_type.config_keys
        having = [spec.label for spec in MODEL_TYPES.values() if component in spec.config_keys]
        why = f"{model_type.label} models have no {label.lower()}"
        for view in registry.all_views():
            if view.path.startswith(container + "."):
                view.set_enabled(enabled, why)
        title = registry.section_titles.get(container)
        if title is not None:
            title.configure(text=label if enabled else f"{label} ({' / '.join(having)} only)")
            set_label_enabled(title, enabled)


def update_unused_fields(registry: FieldRegistry, config: Config) -> None:
    """Grey the settings the config leaves unused (an adapter's options while fine-tuning,
    lr_power without the POLYNOMIAL schedule, ...), the reason in the tooltip; the rest of the
    ruled settings are enabled. A view already in the right state is left alone, and so is a
    setting of a component the model type lacks (`update_component_states` greyed it)."""
    unused = unused_fields(config)
    have = MODEL_TYPES[config.model.type].config_keys
    lacking = tuple(f"{container}." for container in container_labels(Config)
                    if container.startswith("components.")
                    and container.split(".", 1)[1] not in have)
    for view in registry.all_views():
        if view.path not in RULED_PATHS or view.path.startswith(lacking):
            continue
        why = unused.get(view.path, "")
        if view.enabled != (not why) or view.disabled_why != why:
            view.set_enabled(not why, why)


def take_only_values(binding: ConfigBinding, registry: FieldRegistry) -> list[str]:
    """After the model type changed: each setting the new type allows one value of
    (`only_values`: Z-Image samples with Euler only) takes it. What changed, as the window
    names it ("Sampling › Sampler: Euler")."""
    changed = []
    for path, value in only_values(binding.config).items():
        if binding.get(path) != value:
            binding.set_value(path, value)
            shown = (enum_label(value) if isinstance(value, Enum)
                     else format_value(binding.info(path), value) or "empty")
            changed.append(f"{registry.where(path)}: {shown}")
    return changed
