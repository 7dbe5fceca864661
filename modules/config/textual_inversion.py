"""The `textual_inversion` section: the new token(s) a TEXTUAL_INVERSION run trains
(docs/textual_inversion.md). Only read when `training.method` is TEXTUAL_INVERSION; greyed
otherwise (config/field_rules.py)."""
from __future__ import annotations

from dataclasses import dataclass

from modules.config.fields import setting

# A1111 and ComfyUI read at most 75 tokens per prompt chunk: an embedding longer than that
# could never be used whole.
MAX_VECTORS = 75


@dataclass
class TextualInversionConfig:
    placeholder: str = setting(
        "", label="Trigger word", group="Training",
        help="The new token the run trains, as it is written in captions and prompts, e.g. "
             "<mychar>. It must be a string the tokenizer does not already read as one token "
             "(a word of its vocabulary would be shadowed). A caption without it gets it put "
             "in front ('<mychar>, caption'); sample prompts too.")
    vectors: int = setting(
        1, label="Vectors per token", group="Training", min=1, max=MAX_VECTORS,
        help="How many embedding vectors the trigger word stands for (more learn more detail "
             "and take that many of a prompt's 75 tokens; 1 to 8 is usual). The extra vectors "
             "are the tokens <word>_1, <word>_2 ... as diffusers names them.")
    initializer: str = setting(
        "", label="Initializer word", group="Training",
        help="A word whose embedding every vector starts from (e.g. 'person', 'dog', 'style'). "
             "A word the tokenizer splits into several tokens starts from their average.")
