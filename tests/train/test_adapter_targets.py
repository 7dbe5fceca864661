"""Which layers `training.lora_target_modules` adapts (train/recipe/adapters.py
`module_targets`), on the tiny models built on the meta device (no weights, no files): a name
that also matches a container (diffusers' attention keeps its output in `to_out`, a ModuleList)
adapts the layers it names and leaves the container out, so Klein's "to_out" reaches the
single-stream blocks' output projection (BFL's `linear2`); a name that matches containers only
is refused naming the layer inside; every other family's preset targets exactly what it did."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer, check_target_module_exists

from modules.config import Config, apply_overrides
from modules.config.loader import load_config
from modules.config.schema import TrainingMethod
from modules.model_types import ModelType
from modules.models.families import family_of
from modules.train.recipe.adapters import (add_adapter, module_targets, peft_config,
                                           scoped_targets, target_modules)

PRESETS = Path(__file__).resolve().parents[2] / "training_presets"


def _denoiser(model_type: ModelType) -> torch.nn.Module:
    """The tiny model's denoiser, on the meta device."""
    import diffusers
    with torch.device("meta"):
        if model_type == ModelType.KLEIN:
            from modules.models.tiny_klein import TINY_KLEIN
            return diffusers.Flux2Transformer2DModel.from_config(TINY_KLEIN["transformer"])
        if model_type == ModelType.ZIMAGE:
            from modules.models.tiny_zimage import TINY_ZIMAGE
            return diffusers.ZImageTransformer2DModel(**TINY_ZIMAGE["transformer"])
        from modules.models.tiny_sd import TINY_SPECS
        return diffusers.UNet2DConditionModel.from_config(TINY_SPECS[model_type].unet)


def _adapted(module: torch.nn.Module) -> set[str]:
    return {name for name, layer in module.named_modules() if isinstance(layer, BaseTunerLayer)}


def test_kleins_to_out_adapts_the_single_blocks_output_and_a_loader_reads_the_same():
    """The Klein preset's targets: the double blocks' `attn.to_out.0` and the single blocks'
    `attn.to_out` (a Linear there), never the double blocks' `attn.to_out` list; peft's own
    match of the saved config over a fresh model's paths (what a loader given the file's
    metadata does) picks the same layers, so the file's config and tensors agree."""
    config = load_config(PRESETS / "klein" / "lora.json")
    assert "to_out" in config.training.lora_target_modules
    scope = family_of(ModelType.KLEIN).lora_scope
    transformer = _denoiser(ModelType.KLEIN)
    add_adapter(transformer, config, denoiser=True, scope=scope)
    adapted = _adapted(transformer)
    assert {f"single_transformer_blocks.{i}.attn.to_out" for i in (0, 1)} <= adapted
    assert {f"transformer_blocks.{i}.attn.to_out.0" for i in (0, 1)} <= adapted
    # per double block: q, k, v and out of both streams, and both feed-forwards' in and out;
    # per single block: the fused input and output projections
    assert len(adapted) == 2 * 12 + 2 * 2
    saved = transformer.peft_config["default"]
    fresh = _denoiser(ModelType.KLEIN)
    assert {name for name, _ in fresh.named_modules()
            if check_target_module_exists(saved, name)} == adapted
    # the name alone: the two single-block outputs
    alone = _denoiser(ModelType.KLEIN)
    add_adapter(alone, apply_overrides(config, ['training.lora_target_modules=["to_out"]']),
                denoiser=True, scope=scope)
    assert _adapted(alone) == {f"single_transformer_blocks.{i}.attn.to_out" for i in (0, 1)}


def test_a_name_matching_only_module_lists_is_refused_naming_the_layer_inside():
    """SD's `to_out` is a ModuleList in every attention: refused before any adapter goes in,
    naming the entry, what it matched and the layer to name instead (peft's own error named
    neither the entry nor the fix)."""
    unet = _denoiser(ModelType.SD15)
    config = apply_overrides(Config(), ['training.lora_target_modules=["to_q", "to_out"]'])
    with pytest.raises(ValueError) as caught:
        add_adapter(unet, config, denoiser=True)
    message = str(caught.value)
    assert message.startswith("training.lora_target_modules: ")
    assert '"to_out" matches only ModuleLists' in message
    assert 'name the layer inside, "to_out.0"' in message
    assert "to_q" not in message  # the entry that names layers is not blamed
    assert not _adapted(unet) and not hasattr(unet, "peft_config")  # nothing was changed


def _other_families_lora_presets() -> list[str]:
    presets = []
    for path in sorted(PRESETS.rglob("*.json")):
        config = load_config(path)
        if (config.training.method == TrainingMethod.LORA
                and config.model.type != ModelType.KLEIN):
            presets.append(str(path.relative_to(PRESETS)))
    return presets


@pytest.mark.parametrize("preset", _other_families_lora_presets())
@pytest.mark.parametrize("adapter", ["preset", "LOCON"])
def test_every_other_familys_targets_are_what_they_were(preset, adapter):
    """SD 1.5 / 2 / XL and Z-Image: their presets' names (and LoCon's extra layers) match no
    container, so peft is given what it was given before (the suffixes as they are, or the
    family's scoped expression)."""
    config = load_config(PRESETS / preset)
    if adapter != "preset":
        config = apply_overrides(config, [f"training.adapter={adapter}",
                                          "training.conv_rank=2"])
    model_type = config.model.type
    scope = family_of(model_type).lora_scope
    denoiser = _denoiser(model_type)
    linear, convs = target_modules(config, denoiser=True)
    assert module_targets(denoiser, linear + convs, scope) == scoped_targets(linear + convs,
                                                                             scope)
    assert (peft_config(config, True, scope, denoiser).to_dict()
            == peft_config(config, True, scope).to_dict())
    if model_type == ModelType.ZIMAGE and adapter == "preset":
        assert scoped_targets(linear, scope) == (
            rf"(?:{scope})(?:.*\.)?(?:to_q|to_k|to_v|to_out\.0|w1|w2|w3)")


@pytest.mark.parametrize("model_type", [ModelType.SD15, ModelType.KLEIN])
def test_a_name_matching_nothing_among_others_is_refused_naming_it(model_type):
    """A misspelt name beside names that match (peft would adapt the others and pass over it
    without a word): refused before any adapter goes in, naming the entry and the layer it
    may mean; the names that match are not blamed."""
    denoiser = _denoiser(model_type)
    config = apply_overrides(Config(), ['training.lora_target_modules=["to_q", "to_kk"]'])
    with pytest.raises(ValueError) as caught:
        add_adapter(denoiser, config, denoiser=True, scope=family_of(model_type).lora_scope)
    message = str(caught.value)
    assert message.startswith('training.lora_target_modules: "to_kk" matches no layer of the '
                              f"{type(denoiser).__name__}")
    assert "did you mean 'to_k'" in message
    assert '"to_q"' not in message
    assert not _adapted(denoiser) and not hasattr(denoiser, "peft_config")
