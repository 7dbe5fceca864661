"""What a caption becomes when an item is drawn: trigger words, shuffled tags, dropped tags.

Captions written as comma-separated tags (the booru style kohya's and OneTrainer's users
train with) are varied per item and epoch so the model does not learn the tag order:

- `caption_prefix` / `caption_suffix`: trigger words put before / after every caption, never
  shuffled or dropped;
- `shuffle_tags`: the tags in a new order each epoch, except the first `keep_tags`, or
  everything before a `|||` (kohya's keep separator: "sks dog ||| sitting, grass");
- `tag_dropout`: each tag that is not kept is left out with this probability.

The draws come from a generator seeded by (seed, epoch, item): the same caption for the same
item in the same epoch on every run, with any number of loader workers, and after a resume.
With none of these set a caption is used exactly as written. Captions may also come from a
metadata file beside the images (`load_captions_file`).
"""
from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from modules.data.seeds import derive_seed

KEEP_SEPARATOR = "|||"


@dataclass(frozen=True)
class CaptionRules:
    prefix: str = ""
    suffix: str = ""
    shuffle_tags: bool = False
    keep_tags: int = 0
    tag_dropout: float = 0.0

    @property
    def varies(self) -> bool:
        """The caption changes between epochs (so its text encoder output cannot be cached)."""
        return self.shuffle_tags or self.tag_dropout > 0

    @property
    def changes(self) -> bool:
        return self.varies or bool(self.prefix or self.suffix)


def split_tags(text: str) -> list[str]:
    return [tag.strip() for tag in text.split(",") if tag.strip()]


def transform_caption(caption: str, rules: CaptionRules, rng: random.Random) -> str:
    """`caption` after the rules, drawing from `rng`; unchanged when no rule is set."""
    if not rules.changes and KEEP_SEPARATOR not in caption:
        return caption
    kept_text, separator, rest = caption.partition(KEEP_SEPARATOR)
    if separator:
        kept, tags = split_tags(kept_text), split_tags(rest)
    else:
        tags = split_tags(caption)
        kept, tags = tags[:rules.keep_tags], tags[rules.keep_tags:]
    if rules.tag_dropout:
        tags = [tag for tag in tags if rng.random() >= rules.tag_dropout]
    if rules.shuffle_tags:
        rng.shuffle(tags)
    parts = [rules.prefix.strip(), *kept, *tags, rules.suffix.strip()]
    return ", ".join(part for part in parts if part)


def item_caption(caption: str, source_index: int, rules: Sequence[CaptionRules], seed: int,
                 epoch: int, index: int) -> tuple[str, bool]:
    """(the caption item `index` trains with in `epoch`, whether it varies between epochs),
    under its source's rules (none: as written)."""
    if source_index >= len(rules):
        return caption, False
    own = rules[source_index]
    rng = random.Random(derive_seed("caption", seed, epoch, index))
    return transform_caption(caption, own, rng), own.varies


class CaptionsFileError(Exception):
    """A captions file that cannot be read, or an entry of the wrong shape."""


def load_captions_file(path: Path) -> dict[str, str]:
    """Image file name (or path relative to the dataset folder, with `/`) -> caption.

    `.json`: one object, {"image.png": "a caption", ...}. `.jsonl` (the Hugging Face
    `metadata.jsonl` layout): one object per line with "file_name" and a "text", "caption"
    or "tags" string. CaptionsFileError names the line of a bad entry.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise CaptionsFileError(f"{path}: cannot be read ({exc})") from exc
    if Path(path).suffix.lower() == ".jsonl":
        return _jsonl_captions(path, text)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise CaptionsFileError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in data.items()):
        raise CaptionsFileError(f"{path}: expected one object of image name -> caption text")
    return {name.replace("\\", "/"): caption.strip() for name, caption in data.items()}


def _jsonl_captions(path: Path, text: str) -> dict[str, str]:
    captions = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError as exc:
            raise CaptionsFileError(f"{path}, line {number}: not valid JSON ({exc})") from exc
        caption = next((entry.get(key) for key in ("text", "caption", "tags")
                        if isinstance(entry, dict) and isinstance(entry.get(key), str)), None)
        name = entry.get("file_name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or caption is None:
            raise CaptionsFileError(f"{path}, line {number}: expected an object with "
                                    '"file_name" and a "text", "caption" or "tags" string')
        captions[name.replace("\\", "/")] = caption.strip()
    return captions
