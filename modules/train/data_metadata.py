"""What the saved files say about the training data (tag counts, dataset folders, trigger
words), computed once when a run starts from the scan it trains on (models/metadata.py has
the keys and why tools read them)."""
from __future__ import annotations

from dataclasses import replace

from modules.config.schema import Config
from modules.data.captions import transform_caption
from modules.data.folders import ScanResult
from modules.models.metadata import dataset_metadata
from modules.train.start import caption_rules


def training_data_metadata(scan: ScanResult, config: Config) -> dict[str, str]:
    """`ss_tag_frequency` and friends for `scan`: each image's caption as trained (its
    dataset's prefix and suffix added; shuffling and tag dropout, which change per epoch, left
    out), counted per dataset folder (two datasets with the same folder name count together)."""
    rules = caption_rules(config)
    captions, folders = [], {}
    for item in scan.items:
        source = scan.sources[item.source_index]
        fixed = replace(rules[item.source_index], shuffle_tags=False, tag_dropout=0.0)
        captions.append((source.path.name, transform_caption(item.caption, fixed, None)))
    for index, source in enumerate(scan.sources):
        count = sum(1 for item in scan.items if item.source_index == index)
        repeats, images = folders.get(source.path.name, (source.repeats, 0))
        folders[source.path.name] = (repeats, images + count)
    triggers = [ds.caption_prefix for ds in config.data.datasets]
    return dataset_metadata(captions, folders, triggers)
