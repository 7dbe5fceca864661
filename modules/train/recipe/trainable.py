"""What a run trains: which components, at which dtypes, with LoRA adapters added or the full
weights unfrozen, and the memory-saving switches (channels-last, gradient checkpointing) set on
them (how they are saved: train/outputs/saving.py)."""
from __future__ import annotations

import torch
from torch import nn

from modules.config.schema import Config, DType, TrainingMethod, WeightStorage
from modules.model_types import MODEL_TYPES
from modules.models.bundle import TORCH_DTYPES, ModelBundle
from modules.models.families import family_of
from modules.models.weight_storage import quiet_torchao_lora, storage_record, store_weights
from modules.train.recipe.adapters import add_adapter
from modules.train.recipe.textual_inversion import (add_placeholder_tokens, embedding_parameter,
                                                    is_textual_inversion, new_row_ids,
                                                    train_new_rows_only)


def trained_components(config: Config) -> list[str]:
    """Names of the components this run trains, in the model type's order (TEXTUAL_INVERSION:
    every text encoder, whose new token rows train, whatever `components` says)."""
    spec = MODEL_TYPES[config.model.type]
    if is_textual_inversion(config):
        return list(spec.text_encoders)
    return [n for n in spec.components if getattr(config.components, spec.config_key(n)).train]


def component_dtypes(config: Config) -> dict[str, torch.dtype]:
    """The dtype each component is loaded and kept at.

    Frozen weights use `model.weight_dtype`; fully trained components their training dtype from
    the start (loading them at a 16-bit weight dtype first would round the weights the run
    starts from); a VAE whose activations overflow to NaN in float16 (SDXL's) stays float32
    under FLOAT16.
    """
    spec = MODEL_TYPES[config.model.type]
    weight = TORCH_DTYPES[config.model.weight_dtype]
    dtypes = {name: weight for name in spec.components}
    if config.training.method == TrainingMethod.FINE_TUNE:
        for name in trained_components(config):
            dtypes[name] = TORCH_DTYPES[config.model.train_dtype]
    if (family_of(config.model.type).fp16_vae_overflows
            and config.model.weight_dtype == DType.FLOAT16):
        dtypes["vae"] = torch.float32
    return dtypes


def stored_components(config: Config) -> list[str]:
    """The components whose frozen linear weights `model.weight_storage` (FLOAT8, INT8) stores
    in 8 bits: the denoiser and the text encoders (the VAE stays at `model.weight_dtype`: it is
    small and mostly convolutions); W8A8's int8 matmuls the denoiser only (issue 58 item 2: the
    text encoders run once a caption, or not at all with cached captions). None for a full
    fine-tune (validation refuses it)."""
    if (not config.model.weight_storage.eight_bit
            or config.training.method != TrainingMethod.LORA):
        return []
    spec = MODEL_TYPES[config.model.type]
    if config.model.weight_storage == WeightStorage.W8A8:
        return [spec.denoiser]
    return [spec.denoiser, *spec.text_encoders]


def apply_weight_storage(bundle: ModelBundle, config: Config) -> None:
    """Store the frozen weights as `model.weight_storage` says, on a bundle that is not made
    trainable (*Check compilation* traces the layers training compiles); `prepare_trainable`
    does the same on its way."""
    for name in stored_components(config):
        store_weights(bundle.component(name).requires_grad_(False),
                      config.model.weight_storage.value)


def weight_storage_record(bundle: ModelBundle, config: Config) -> dict:
    """run.json's `weight_storage`: how the frozen weights were kept (FLOAT8, INT8: which
    layers of which components, their bytes, the library)."""
    stored = stored_components(config)
    if not stored:
        return {"storage": WeightStorage.WEIGHT_DTYPE.value,
                "dtype": config.model.weight_dtype.value}
    # a text encoder released once its captions were cached (train/setup/text_first.py) is
    # no longer there to describe
    present = bundle.components()
    return storage_record({name: present[name] for name in stored if name in present},
                          config.model.weight_storage.value)


def prepare_trainable(bundle: ModelBundle, config: Config) -> dict[str, list[nn.Parameter]]:
    """Freeze everything, then make the trained parts trainable; return their parameters.

    TEXTUAL_INVERSION adds the trigger word's tokens and trains each text encoder's token
    embedding, its old rows kept (train/recipe/textual_inversion.py).
    LoRA adds the configured peft adapter in place (train/recipe/adapters.py: LoRA, LoCon, LoHa, LoKr
    or DoRA) so each component keeps its class and its state-dict keys, which the compile
    engine and the savers rely on. Trainable tensors (full weights or adapters) are kept at
    `model.train_dtype`. With `model.weight_storage` FLOAT8 or INT8 the frozen linear layers are
    stored in 8 bits first (models/weight_storage.py), so the adapters wrap the stored layers.
    """
    trained = trained_components(config)
    dtypes = component_dtypes(config)
    stored = stored_components(config)
    train_dtype = TORCH_DTYPES[config.model.train_dtype]
    params: dict[str, list[nn.Parameter]] = {}
    if is_textual_inversion(config):
        add_placeholder_tokens(bundle, config)
    for name, module in bundle.components().items():
        module.requires_grad_(False)
        if module.dtype != dtypes[name]:
            # transformers' PreTrainedModel.to is @wraps(nn.Module.to): typeshed's _Wrapped
            # keeps the unbound signature, so mypy misses `self`
            module.to(dtype=dtypes[name])  # type: ignore[call-arg]  # see above
        module.eval()
        if name in stored:
            store_weights(module, config.model.weight_storage.value)
        if name not in trained:
            continue
        if config.training.method == TrainingMethod.LORA:
            denoiser = name == bundle.denoiser_name
            with quiet_torchao_lora():
                add_adapter(module, config, denoiser=denoiser,
                            scope=family_of(bundle.model_type).lora_scope if denoiser else None)
        elif is_textual_inversion(config):
            if bundle.tokenizers:  # the memory plan's weightless bundle has none
                train_new_rows_only(module, new_row_ids(bundle, config, name), dtypes[name])
            else:
                embedding_parameter(module).requires_grad_(True)
        else:
            module.requires_grad_(True)
        trainable = [p for p in module.parameters() if p.requires_grad]
        for p in trainable:
            p.data = p.data.to(train_dtype)
        module.train()
        params[name] = trainable
    return params


def denoiser_memory_format(config: Config) -> torch.memory_format:
    """The denoiser's memory layout (`training.channels_last`), for its weights and its input."""
    return torch.channels_last if config.training.channels_last else torch.contiguous_format


def apply_denoiser_memory_format(bundle: ModelBundle, config: Config) -> None:
    """Store the denoiser's 4-D weights channels-last when asked (before it is compiled, so the
    compiled code is traced with the layout it runs with). Convolutions then keep their
    activations channels-last too, the layout NVIDIA tensor cores read without transposes."""
    if config.training.channels_last:
        bundle.denoiser.to(memory_format=torch.channels_last)


def enable_gradient_checkpointing(bundle: ModelBundle, trained: list[str]) -> None:
    """Recompute activations of the trained components in backward to save memory."""
    for name in trained:
        module = bundle.component(name)
        if name == bundle.denoiser_name:
            family_of(bundle.model_type).enable_gradient_checkpointing(module)
        else:
            module.gradient_checkpointing_enable()
