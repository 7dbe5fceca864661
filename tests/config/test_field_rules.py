"""The unused-settings rules (modules/config/field_rules.py): which fields the config leaves
unused and the reason each gives, read from the adapters and optimizers tables."""
from __future__ import annotations

import dataclasses

from modules.config import Config
from modules.config.adapters import ADAPTERS
from modules.config.field_rules import ADAPTER_FIELDS, RULED_PATHS, unused_fields
from modules.config.introspect import iter_fields
from modules.config.schema import (Adapter, DatasetConfig, LRScheduler, Optimizer,
                                   TimestepSampling,
                                   TrainingMethod)


def test_every_ruled_path_is_a_config_field():
    paths = {info.dotted_path for info in iter_fields(Config)}
    assert RULED_PATHS <= paths, RULED_PATHS - paths


def test_fine_tuning_greys_every_adapter_field_with_the_reason():
    config = Config()
    config.training.method = TrainingMethod.FINE_TUNE
    unused = unused_fields(config)
    assert set(ADAPTER_FIELDS) <= set(unused)
    assert {"training.adapter", "training.lokr_factor", "training.lora_rank"} <= set(unused)
    assert unused["training.use_rslora"] == "FINE_TUNE trains the full weights, with no adapter"


def test_each_adapter_leaves_unused_exactly_the_options_it_lacks():
    for adapter, row in ADAPTERS.items():
        config = Config()
        config.training.adapter = adapter
        unused = unused_fields(config)
        for option in ("use_rslora", "lora_dropout", "module_dropout", "rank_dropout",
                       "lokr_factor"):
            assert (f"training.{option}" in unused) == (option not in row.options), (adapter,
                                                                                     option)
        assert ("training.conv_rank" in unused) == (not row.convolutions)
    config = Config()
    config.training.adapter = Adapter.LOHA
    assert unused_fields(config)["training.lokr_factor"] == "LoHa has no such option (LOKR have it)"
    assert unused_fields(config)["training.lora_dropout"] == (
        "LoHa has no such option (LORA / LOCON / DORA have it)")
    assert unused_fields(Config())["training.conv_alpha"].startswith("LoRA adapts no convolution")


def test_schedule_options_follow_the_schedule_and_the_optimizer():
    config = Config()
    unused = unused_fields(config)
    assert unused["training.lr_cycles"] == ("only the COSINE_WITH_RESTARTS schedule reads it "
                                            "(CONSTANT is chosen)")
    assert "training.lr_power" in unused and "training.learning_rate" not in unused
    config.training.lr_scheduler = LRScheduler.POLYNOMIAL
    unused = unused_fields(config)
    assert "training.lr_power" not in unused and "training.lr_cycles" in unused
    config.training.optimizer = Optimizer.SCHEDULE_FREE_ADAMW
    unused = unused_fields(config)
    assert unused["training.lr_power"] == "Schedule-free AdamW replaces the schedule"
    assert "training.lr_warmup_steps" not in unused          # a warm-up still applies
    config.training.optimizer = Optimizer.ADAFACTOR_RELATIVE
    unused = unused_fields(config)
    for path in ("training.learning_rate", "training.lr_warmup_steps", "training.lr_power"):
        assert unused[path] == "Adafactor (relative step) sets its own step size"
    assert "training.lr_scheduler" not in unused              # validation may ask to change it


def test_data_sampling_and_ema_fields():
    config = Config()
    unused = unused_fields(config)
    assert unused["training.prior_loss_weight"] == "no dataset is marked as regularisation images"
    assert unused["data.bucket_max_aspect"] == "aspect-ratio buckets are off"
    assert unused["training.ema_decay"] == "EMA is off"
    assert "sampling.steps" not in unused
    config.data.datasets.append(DatasetConfig(regularization=True))
    config.data.aspect_buckets, config.training.ema = True, True
    config.sampling.prompts = []
    unused = unused_fields(config)
    assert not {"training.prior_loss_weight", "data.bucket_max_aspect",
                "training.ema_decay"} & set(unused)
    assert unused["sampling.steps"] == "there are no prompts, so nothing is sampled"
    config.sampling.prompts_file = "prompts.txt"
    assert "sampling.steps" not in unused_fields(config)


def test_each_objectives_settings_are_greyed_for_the_other_family_while_off():
    from modules.config.field_rules import DDPM_ONLY, FLOW_ONLY
    from modules.model_types import ModelType
    sd, zimage = Config(), Config()
    zimage.model.type = ModelType.ZIMAGE
    assert set(FLOW_ONLY) <= set(unused_fields(sd))
    assert not set(DDPM_ONLY) & set(unused_fields(sd))
    unused = unused_fields(zimage)
    assert set(DDPM_ONLY) <= set(unused) and not set(FLOW_ONLY) & set(unused)
    assert unused["training.min_snr_gamma"] == ("Z-Image is trained with flow matching, which "
                                                "has no DDPM schedule")
    zimage.training.min_snr_gamma = 5.0   # refused by validation: left editable to undo
    assert "training.min_snr_gamma" not in unused_fields(zimage)
    logit = dataclasses.replace(zimage.loss, timestep_sampling=TimestepSampling.LOGIT_NORMAL)
    assert "loss.logit_std" in unused
    assert "loss.logit_std" not in unused_fields(Config(loss=logit))


def test_the_settings_only_zimage_reads_are_unused_for_the_other_types():
    """Issue 54 item 4: Z-Image's files and distillation guard stayed enabled on SD presets.
    The model-type table says which type reads them; its ComfyUI-files loader agrees."""
    from modules.model_types import MODEL_TYPES, ModelType
    from modules.models.split_files import FIELDS
    own = MODEL_TYPES[ModelType.ZIMAGE].own_settings
    assert set(FIELDS.values()) - {"model.path"} <= set(own)
    assert "model.train_distilled" in own
    zimage = Config()
    zimage.model.type = ModelType.ZIMAGE
    assert not set(own) & set(unused_fields(zimage))
    for model_type in (ModelType.SD15, ModelType.SD2, ModelType.SDXL):
        config = Config()
        config.model.type = model_type
        label = MODEL_TYPES[model_type].label
        # the distillation guard and the split files are Klein's too
        having = {path: " / ".join(s.label for s in MODEL_TYPES.values()
                                   if path in s.own_settings) for path in own}
        assert having["model.text_encoder_path"] == "Z-Image / Flux.2 Klein"
        assert having["model.train_distilled"] == "Z-Image / Flux.2 Klein"
        # a single file's tokenizer and configs SD's checkpoints read too
        shared = set(own) & set(MODEL_TYPES[model_type].own_settings)
        assert shared == {"model.tokenizer_path", "model.config_path"}
        assert not shared & set(unused_fields(config))
        assert {path: unused_fields(config)[path] for path in own if path not in shared} == {
            path: f"{label} models do not read it ({having[path]} only)" for path in own
            if path not in shared}


def test_a_setting_the_model_type_allows_one_value_of_is_named_with_it():
    from modules.config.field_rules import DDPM_ONLY, FLOW_ONLY, only_values
    from modules.config.outputs import Sampler
    from modules.config.validate import validate
    from modules.model_types import ModelType
    sd, zimage = Config(), Config()
    zimage.model.type = ModelType.ZIMAGE
    assert only_values(sd) == FLOW_ONLY                      # every sampler is an SD one
    assert only_values(zimage) == {**DDPM_ONLY, "sampling.sampler": Sampler.EULER}
    # the values are the ones validation accepts: another one of each is refused
    zimage.sampling.prompts = ["a cat"]
    zimage.sampling.sampler = Sampler.DDIM
    assert "sampling.sampler" in {p.path for p in validate(zimage)}
    zimage.sampling.sampler = only_values(zimage)["sampling.sampler"]
    assert "sampling.sampler" not in {p.path for p in validate(zimage)}


def test_validation_images_and_details_are_greyed_while_validation_is_off():
    config = Config()
    unused = unused_fields(config)
    for path in ("validation.split_ratio", "validation.folder", "validation.timesteps",
                 "validation.batch_size", "validation.save_best"):
        assert unused[path] == "validation is off (validation.every_steps is 0)", path
    config.validation.split_ratio = 0.1   # refused by validation while off: left editable
    unused = unused_fields(config)
    assert "validation.split_ratio" not in unused and "validation.folder" in unused
    config.validation.every_steps = 10
    assert not {p for p in unused_fields(config) if p.startswith("validation.")}
