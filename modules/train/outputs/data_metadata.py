"""What the saved files say about the training data (tag counts, dataset folders, trigger
words), computed once when a run starts from the scan it trains on (models/metadata.py has
the keys and why tools read them)."""
from __future__ import annotations

import random
from dataclasses import replace

from modules.config.schema import Config
from modules.data.captions import transform_caption
from modules.data.folders import ScanResult
from modules.models.metadata import dataset_metadata
from modules.train.setup.run_captions import caption_rules


def training_data_metadata(scan: ScanResult, config: Config) -> dict[str, str]:
    """`ss_tag_frequency` and friends for `scan`: each image's caption as trained (its
    dataset's prefix and suffix added; shuffling and tag dropout, which change per epoch, left
    out), counted per folder as kohya counts them: an image in a kohya `N_name` subfolder under
    that subfolder's name, with its repeats (N times its dataset's), any other under its
    dataset's folder name. Two folders with the same name count together (the first one's
    repeats)."""
    rules = caption_rules(config)
    captions: list[tuple[str, str]] = []
    folders: dict[str, tuple[int, int]] = {}
    no_draws = random.Random(0)  # the rules below neither shuffle nor drop: nothing is drawn
    for item in scan.items:
        source = scan.sources[item.source_index]
        name = item.repeat_folder or source.path.name
        fixed = replace(rules[item.source_index], shuffle_tags=False, tag_dropout=0.0)
        captions.append((name, transform_caption(item.caption, fixed, no_draws)))
        repeats, images = folders.get(name, (source.repeats * item.repeats, 0))
        folders[name] = (repeats, images + 1)
    # a regularisation folder's prefix names the class, not what the LoRA adds
    triggers = [ds.caption_prefix for ds in config.data.datasets if not ds.regularization]
    return dataset_metadata(captions, folders, triggers)
