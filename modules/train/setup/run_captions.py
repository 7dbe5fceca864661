"""The captions a run reads, from its config and its scanned data: each dataset's caption rules
and every caption a run whose captions do not vary will encode. Below both `start` (the
dataset and the caption cache) and `text_first` (the captions encoded before the model loads),
which import it from here."""
from __future__ import annotations

from typing import Any, Protocol

from modules.config.schema import Config
from modules.data.captions import CaptionRules


class ScannedRun(Protocol):
    """What the captions are read from: a checked or prepared run (train/setup/prepare.py,
    which sits above this file)."""
    config: Config
    scan: Any         # the datasets' scan (its items' captions)
    validation: Any   # the held-out images, or None
    prompts: Any      # the sample prompts


def caption_rules(config) -> list[CaptionRules]:
    """Each dataset's caption rules (modules/data/captions.py), by its place in the list."""
    return [CaptionRules(ds.caption_prefix, ds.caption_suffix, ds.shuffle_tags, ds.keep_tags,
                         ds.tag_dropout) for ds in config.data.datasets]



def known_captions(prepared: ScannedRun) -> list[str]:
    """Every caption a run whose captions do not vary will read: each training image's (its
    dataset's prefix and suffix applied), "" when captions may be dropped, the validation
    images', and the sample prompts and negative prompts."""
    from modules.data.captions import item_caption
    config = prepared.config
    rules = caption_rules(config)
    captions = [item_caption(item.caption, item.source_index, rules, config.training.seed, 0,
                             index)[0] for index, item in enumerate(prepared.scan.items)]
    dropouts = [config.data.caption_dropout, *(ds.caption_dropout or 0.0
                                               for ds in config.data.datasets)]
    if any(dropouts):
        captions.append("")
    if prepared.validation is not None:
        held = prepared.validation
        captions += [item_caption(item.caption, item.source_index, held.rules,
                                  config.training.seed, 0, index)[0]
                     for index, item in enumerate(held.items)]
    for prompt in prepared.prompts:  # check_run's read: the prompts the run samples
        captions += [prompt.text, prompt.negative]
    return list(dict.fromkeys(captions))
