"""The `data` and `validation` sections of the config: the training images and their captions,
and the images a run is scored on (docs/datasets.md, docs/validation.md).

Kept beside `schema.py`, which holds the rest of the tree and names these sections in
`Config`, so the file of each stays readable.
"""
from __future__ import annotations

from dataclasses import dataclass

from modules.config.fields import OnResume, setting
from modules.model_types import BUILTIN_SHAPES


@dataclass
class DatasetConfig:
    path: str = setting(BUILTIN_SHAPES, label="Folder", group="Data", path=True,
                        help="A folder of images with same-name .txt captions, or "
                             "'builtin:shapes' (a generated set of coloured shapes).")
    repeats: int = setting(1, label="Repeats", group="Data", min=1, max=10_000,
                           help="How many times each image of this folder is seen per epoch.")
    shuffle_tags: bool = setting(
        False, label="Shuffle tags", group="Data",
        help="Captions are comma-separated tags: train them in a new order each epoch (the "
             "first 'keep tags', or what comes before '|||', stay in place).")
    keep_tags: int = setting(0, label="Keep tags", group="Data", min=0, max=1000,
                             help="How many leading tags shuffling and tag dropout leave alone.")
    tag_dropout: float = setting(
        0.0, label="Tag dropout", group="Data", min=0.0, max=1.0,
        help="Leave out each tag (not a kept one) with this probability, drawn anew each "
             "epoch.")
    caption_prefix: str = setting(
        "", label="Caption prefix", group="Data",
        help="Put before every caption of this folder (trigger words, e.g. 'sks dog'); never "
             "shuffled or dropped.")
    caption_suffix: str = setting("", label="Caption suffix", group="Data",
                                  help="Put after every caption of this folder.")
    captions_file: str = setting(
        "", label="Captions file", group="Data", path=True, files=("*.json", "*.jsonl"),
        help="Captions from a metadata file instead of .txt files: .json {\"image.png\": "
             "\"caption\"} or .jsonl lines with \"file_name\" and \"text\" (Hugging Face's "
             "metadata.jsonl). An image it does not list uses its .txt file. Empty: none.")
    class_caption: str = setting(
        "", label="Class caption", group="Data",
        help="The caption of an image of this folder that has no caption file (kohya's class "
             "tokens), e.g. 'a photo of a dog' for regularisation images. Empty: such an "
             "image trains with an empty caption.")
    caption_dropout: float | None = setting(
        None, label="Caption dropout", group="Data", min=0.0, max=1.0,
        help="Probability that an image of this folder trains on an empty caption instead; "
             "empty uses data.caption_dropout (e.g. 0 for regularisation images, or a higher "
             "value for a style folder).")
    regularization: bool = setting(
        False, label="Regularisation images", group="Data",
        help="This folder holds class images for prior preservation (DreamBooth): each epoch "
             "mixes in as many of their samples as there are training samples, and their loss "
             "counts training.prior_loss_weight times. docs/datasets.md gives the rule.")
    resolutions: list[int] = setting(
        default_factory=list, label="Resolutions", group="Data",
        help="This folder's own training side lengths (e.g. 1024 only for a folder of large "
             "images); empty uses data.resolutions (or data.resolution).")


@dataclass
class DataConfig:
    datasets: list[DatasetConfig] = setting(
        default_factory=lambda: [DatasetConfig()], label="Datasets", group="Data",
        help="One or more image folders, each with its own repeat count.")
    recursive: bool = setting(
        True, label="Include subfolders", group="Data",
        help="Images in subfolders train too, each with its caption beside it; a top-level "
             "subfolder named N_name (the kohya layout, e.g. 10_subject) repeats its images N "
             "times per epoch. Off: only the images directly in each folder.")
    resolution: int = setting(512, label="Resolution", group="Data", min=64, max=4096,
                              compile_check=True,
                              help="Training side length in pixels; must be a multiple of 64.")
    resolutions: list[int] = setting(
        default_factory=list, label="Resolutions", group="Data", compile_check=True,
        help="Train every image at each of these side lengths (e.g. 512, 768, 1024), each with "
             "its own square or aspect buckets; an epoch is images x resolutions. Must hold "
             "data.resolution (samples and validation use it). Empty: data.resolution only.")
    center_crop: bool = setting(True, label="Center crop", group="Data",
                                help="Crop the center after resizing; off means a random crop.")
    random_flip: bool = setting(False, label="Random flip", group="Data",
                                help="Flip images horizontally at random.")
    aspect_buckets: bool = setting(
        False, label="Aspect-ratio buckets", group="Data",
        help="Train each image at the bucket size nearest its aspect ratio (sides multiples of "
             "64, about resolution x resolution pixels) instead of a square crop; each batch "
             "holds one bucket. Off crops every image to a square.")
    bucket_max_aspect: float = setting(
        2.0, label="Max bucket aspect", group="Data", min=1.0, max=4.0, advanced=True,
        help="Longest over shortest side of the most elongated bucket; images beyond it go to "
             "that bucket and lose more to the crop. Only used with aspect-ratio buckets.")
    cache_latents: bool = setting(False, label="Cache latents", group="Data",
                                  help="Encode every image with the VAE once and keep the latents "
                                       "on disk; the VAE then stays on the CPU, on the GPU "
                                       "only for sampling (docs/memory.md).")
    caption_extension: str = setting(".txt", label="Caption extension", group="Data", advanced=True,
                                     help="File extension of the caption next to each image.")
    masked_loss: bool = setting(
        False, label="Masked loss", group="Data",
        help="Train only the parts of each image its mask keeps: a greyscale <image "
             "name>_mask.png beside the image (white counts, black is left out), else the "
             "image's alpha channel; an image with neither counts whole. docs/datasets.md "
             "says more.")
    caption_dropout: float = setting(0.0, label="Caption dropout", group="Data", min=0.0, max=1.0,
                                     help="Probability of training on an empty caption instead "
                                          "(helps classifier-free guidance); a dataset's own "
                                          "caption dropout, when set, replaces it.")
    cache_text_encoder_outputs: bool = setting(
        False, label="Cache text encoder outputs", group="Data",
        help="Encode each distinct caption once and reuse it (only when no text encoder is "
             "trained). When every caption is known up front (no shuffled or dropped tags), "
             "they are all encoded first and the text encoder(s) then stay on the CPU "
             "(docs/memory.md).")
    workers: int = setting(0, label="Dataloader workers", group="Data", min=0, max=64, advanced=True,
                           on_resume=OnResume.MAY_CHANGE,
                           help="Background processes that load images; 0 loads in the trainer.")


@dataclass
class ValidationConfig:
    every_steps: int = setting(
        0, label="Validate every N steps", group="Data", min=0, max=100_000_000,
        help="Score the held-out images every N optimizer steps (and at the end of the run); "
             "0 turns validation off (no image is held out). docs/validation.md.")
    split_ratio: float = setting(
        0.0, label="Held-out fraction", group="Data", min=0.0, max=0.5,
        on_resume=OnResume.MUST_MATCH,  # which images train (validate() ties every_steps to it)
        help="Hold this fraction of the training images out for validation (chosen from the "
             "seed and each file's name, so the same images on every run and resume); they "
             "are not trained on. 0: use the validation folder instead.")
    folder: str = setting(
        "", label="Validation folder", group="Data", path=True,
        help="A separate folder of validation images with their captions (instead of a "
             "held-out fraction). Empty: none.")
    timesteps: int = setting(
        4, label="Validation timesteps", group="Data", min=1, max=1000, advanced=True,
        help="Each validation image is scored at this many fixed, evenly spaced timesteps "
             "with fixed noise, so the number is comparable from step to step.")
    batch_size: int = setting(
        0, label="Validation batch size", group="Data", min=0, max=4096, advanced=True,
        help="Images per validation forward pass; 0 uses training.batch_size. It changes only "
             "speed and memory, not the score's noise (drawn per image).")
    save_best: bool = setting(
        False, label="Keep the best weights", group="Data",
        help="Each time the validation loss is lower than at every earlier pass, save the "
             "weights (in output.formats) into best/ in the output folder, replacing the "
             "previous best only once the new one is complete. Needs validation "
             "(validation.every_steps). docs/validation.md.")


def source_resolutions(data: DataConfig) -> list[list[int]]:
    """The resolutions each dataset trains at, by its place in data.datasets: its own list,
    else data.resolutions, else [data.resolution]."""
    run = data.resolutions or [data.resolution]
    return [list(ds.resolutions or run) for ds in data.datasets]


def trained_resolutions(data: DataConfig) -> list[int]:
    """Every resolution some dataset trains at, smallest first."""
    return sorted({r for listed in source_resolutions(data) for r in listed})


def shapes_vary(data: DataConfig) -> bool:
    """Batches come in more than one shape: aspect buckets, or several resolutions."""
    return data.aspect_buckets or len(trained_resolutions(data)) > 1
