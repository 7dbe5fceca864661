"""What is trained (LoRA adapters or full weights) and how it is saved, atomically."""
from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import nn

from modules.config.schema import Config, TrainingMethod
from modules.models.loader import ModelBundle
from modules.models.types import MODEL_TYPES
from modules.util.atomic import atomic_write_dir

# LoRA target layers of CLIP text encoders (the UNet's come from training.lora_target_modules).
TEXT_ENCODER_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def trained_components(config: Config) -> list[str]:
    """Names of the components this run trains, in the model type's order."""
    spec = MODEL_TYPES[config.model.type]
    return [n for n in spec.components if getattr(config.components, n).train]


def prepare_trainable(bundle: ModelBundle, config: Config, weight_dtype: torch.dtype,
                      train_dtype: torch.dtype) -> dict[str, list[nn.Parameter]]:
    """Freeze everything, then make the trained parts trainable; return their parameters.

    LoRA adds peft adapters in place (`add_adapter`) so each component keeps its class and its
    state-dict keys, which the compile engine and the savers rely on.
    """
    from peft import LoraConfig

    trained = trained_components(config)
    params: dict[str, list[nn.Parameter]] = {}
    for name, module in bundle.components().items():
        module.requires_grad_(False)
        if module.dtype != weight_dtype:
            module.to(dtype=weight_dtype)
        module.eval()
        if name not in trained:
            continue
        if config.training.method == TrainingMethod.LORA:
            targets = (config.training.lora_target_modules if name == "unet"
                       else TEXT_ENCODER_LORA_TARGETS)
            module.add_adapter(LoraConfig(r=config.training.lora_rank,
                                          lora_alpha=config.training.lora_alpha,
                                          init_lora_weights="gaussian",
                                          target_modules=list(targets)))
        else:
            module.requires_grad_(True)
        trainable = [p for p in module.parameters() if p.requires_grad]
        for p in trainable:
            p.data = p.data.to(train_dtype)
        module.train()
        params[name] = trainable
    return params


def enable_gradient_checkpointing(bundle: ModelBundle, trained: list[str]) -> None:
    """Recompute activations of the trained components in backward to save memory."""
    for name in trained:
        module = bundle.component(name)
        if name == "unet":
            module.enable_gradient_checkpointing()
        else:
            module.gradient_checkpointing_enable()


def save_lora(bundle: ModelBundle, config: Config, folder: Path) -> Path:
    """Save the LoRA adapters in the diffusers/peft layout (`load_lora_weights` reads it)."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    pipeline_cls = {"StableDiffusionPipeline": StableDiffusionPipeline,
                    "StableDiffusionXLPipeline": StableDiffusionXLPipeline}[
        MODEL_TYPES[config.model.type].pipeline_class]
    kwargs = {}
    for name in trained_components(config):
        module = bundle.component(name)
        layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(module))
        kwargs[f"{name}_lora_layers"] = {k: v.detach().to(torch.float32).contiguous()
                                         for k, v in layers.items()}
        kwargs[f"{name}_lora_adapter_metadata"] = module.peft_config["default"].to_dict()

    def write(tmp: Path) -> None:
        pipeline_cls.save_lora_weights(save_directory=tmp, weight_name=LORA_WEIGHT_NAME,
                                       safe_serialization=True, **kwargs)
    atomic_write_dir(folder, write)
    return folder / LORA_WEIGHT_NAME


def save_full(bundle: ModelBundle, config: Config, folder: Path) -> Path:
    """Save the whole model as a diffusers folder (`from_pretrained` reads it)."""
    pipeline = build_pipeline(bundle, config)
    atomic_write_dir(folder, lambda tmp: pipeline.save_pretrained(tmp, safe_serialization=True))
    return folder


def save_weights(bundle: ModelBundle, config: Config, folder: Path) -> list[Path]:
    """Save what this run trains, in every configured format; return the files written."""
    if config.training.method == TrainingMethod.LORA:
        return [save_lora(bundle, config, folder)]
    return [save_full(bundle, config, folder)]


def build_pipeline(bundle: ModelBundle, config: Config, scheduler=None):
    """A diffusers pipeline over the bundle's (possibly LoRA-adapted) live components."""
    import diffusers

    spec = MODEL_TYPES[config.model.type]
    cls = getattr(diffusers, spec.pipeline_class)
    parts = {"unet": bundle.unet, "vae": bundle.vae,
             "scheduler": scheduler or bundle.noise_scheduler,
             **bundle.text_encoders, **bundle.tokenizers}
    if spec.pipeline_class == "StableDiffusionPipeline":
        parts.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    else:
        parts.update(image_encoder=None, feature_extractor=None)
    known = set(inspect.signature(cls.__init__).parameters)
    return cls(**{k: v for k, v in parts.items() if k in known})

