"""The metadata A1111's and Forge's extra-networks panels read from a saved LoRA: tag counts
from the captions as trained, the dataset, trigger words, resolution, network args, and the
file hash they show."""
from __future__ import annotations

import hashlib
import json

from safetensors import safe_open

from modules.config import Config
from modules.config.schema import DatasetConfig, ModelType
from modules.data.folders import DatasetSource, scan_datasets
from modules.models.metadata import a1111_card, network_metadata, tag_frequency
from modules.train.outputs.data_metadata import training_data_metadata
from modules.train.trainer import train
from tests.train.test_checkpoints import caption_folder


def addnet_hash(path) -> str:
    """sha256 of the bytes after the safetensors header (how A1111 hashes a LoRA file)."""
    data = path.read_bytes()
    return hashlib.sha256(data[8 + int.from_bytes(data[:8], "little"):]).hexdigest()


def test_tag_frequency_counts_each_tag_once_per_image():
    assert tag_frequency([("a", "red, circle, red"), ("a", " red ,square"), ("b", "x,,")]) == {
        "a": {"red": 2, "circle": 1, "square": 1}, "b": {"x": 1}}


def test_network_args_say_the_adapter_as_kohya_and_lycoris_write_them():
    locon = network_metadata({"adapter": "LOCON", "lora_target_modules": ["to_q"],
                              "conv_rank": 8, "conv_alpha": 4.0, "lora_rank": 16,
                              "lora_alpha": 8.0})
    assert locon["ss_network_module"] == "networks.lora" and locon["ss_network_dim"] == "16"
    assert json.loads(locon["ss_network_args"]) == {"target_modules": ["to_q"], "conv_dim": "8",
                                                    "conv_alpha": "4.0"}
    loha = network_metadata({"adapter": "LOHA", "lora_target_modules": ["to_q"],
                             "rank_dropout": 0.1, "lora_rank": 4, "lora_alpha": 4.0})
    assert loha["ss_network_module"] == "lycoris.kohya"
    assert json.loads(loha["ss_network_args"]) == {"target_modules": ["to_q"], "algo": "loha",
                                                   "rank_dropout": "0.1"}


def test_a_kohya_lora_says_what_it_was_trained_on(tiny_config, tmp_path):
    images = caption_folder(tmp_path / "5_dogs")
    result = train(tiny_config(f"data.datasets[0].path={images}", "data.datasets[0].repeats=2",
                               "data.datasets[0].caption_prefix=sks dog",
                               "training.max_steps=1", "training.lora_rank=4",
                               "output.formats=kohya", "output.save_dtype=FLOAT16",
                               f"output.dir={tmp_path / 'my-lora'}"))
    path = result.output_dir / "final" / "lora_kohya.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    # 5 captions (test_checkpoints.CAPTIONS), each with the prefix, counted once per image
    assert json.loads(meta["ss_tag_frequency"]) == {"5_dogs": {
        "sks dog": 5, "red": 3, "circle": 3, "plain": 2, "square": 1, "blue": 1,
        "triangle": 1, "green": 1}}
    assert json.loads(meta["ss_dataset_dirs"]) == {"5_dogs": {"n_repeats": 2, "img_count": 5}}
    assert meta["ss_num_train_images"] == "10"
    assert meta["modelspec.trigger_phrase"] == "sks dog"
    assert meta["ss_output_name"] == "my-lora"
    assert meta["ss_resolution"] == "(64, 64)"
    assert meta["ss_network_dim"] == "4" and meta["ss_network_module"] == "networks.lora"
    assert json.loads(meta["ss_network_args"]) == {
        "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
    assert meta["sshs_model_hash"] == addnet_hash(path)
    # the card A1111 / Forge read from <file stem>.json beside the LoRA
    card = json.loads((path.parent / "lora_kohya.json").read_text(encoding="utf-8"))
    assert card == {"description": "LoRA for Stable Diffusion 1.x, trained with Tempera for 1 "
                                   "steps.",
                    "sd version": "SD1", "activation text": "sks dog", "preferred weight": 0,
                    "notes": card["notes"]}
    assert card["notes"].startswith("Base model: tiny-sd15")  # the built-in model's folder


def test_kohya_repeat_subfolders_count_under_their_own_names(tmp_path):
    """kohya keys ss_tag_frequency and ss_dataset_dirs by the `N_name` subfolder, with N (times
    the dataset's repeats); an image outside such a subfolder counts under the dataset."""
    root = tmp_path / "pets"
    caption_folder(root / "10_dogs", ["dog, brown", "dog"])
    caption_folder(root / "3_cats", ["cat"])
    caption_folder(root / "misc", ["bird"])                # not N_name: the dataset's
    config = Config()
    config.data.datasets[0] = DatasetConfig(path=str(root), repeats=2, caption_prefix="pet")
    scan = scan_datasets([DatasetSource(root, 2)], recursive=True)
    assert [item.repeat_folder for item in scan.items] == ["10_dogs", "10_dogs", "3_cats", ""]
    meta = training_data_metadata(scan, config)
    assert json.loads(meta["ss_tag_frequency"]) == {
        "10_dogs": {"pet": 2, "dog": 2, "brown": 1}, "3_cats": {"pet": 1, "cat": 1},
        "pets": {"pet": 1, "bird": 1}}
    assert json.loads(meta["ss_dataset_dirs"]) == {
        "10_dogs": {"n_repeats": 20, "img_count": 2}, "3_cats": {"n_repeats": 6, "img_count": 1},
        "pets": {"n_repeats": 2, "img_count": 1}}
    assert meta["ss_num_train_images"] == str(scan.num_samples_per_epoch) == "48"


def test_the_a1111_card_names_each_model_types_sd_version():
    # the families A1111 can load (Z-Image's LoRAs are for ComfyUI and diffusers)
    versions = {t: a1111_card(t, "", "")["sd version"]
                for t in (ModelType.SD15, ModelType.SD2, ModelType.SDXL)}
    assert versions == {ModelType.SD15: "SD1", ModelType.SD2: "SD2", ModelType.SDXL: "SDXL"}


def test_trigger_words_leave_out_the_regularisation_folders_prefix(tmp_path):
    dogs, reg = caption_folder(tmp_path / "dogs", ["x"]), caption_folder(tmp_path / "reg", ["y"])
    config = Config()
    config.data.datasets = [DatasetConfig(path=str(dogs), caption_prefix="sks dog"),
                            DatasetConfig(path=str(reg), caption_prefix="dog",
                                          regularization=True)]
    scan = scan_datasets([DatasetSource(dogs), DatasetSource(reg, regularization=True)])
    assert training_data_metadata(scan, config)["modelspec.trigger_phrase"] == "sks dog"
