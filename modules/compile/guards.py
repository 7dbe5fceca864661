"""Dynamo's guard-failure text in plain words, for one-sentence recompile messages.

Dynamo explains a recompile with the guard that failed ("0/1: tensor 'args[0]' size mismatch at
index 0. expected 2, actual 3", or a multi-line attribute check with a user stack). The status
line shows `summarize_guard_failure`'s few words; the full text goes to the log and run.json.
Unknown forms fall back to their first line, shortened, so a new torch never hides a reason.
"""
from __future__ import annotations

import re

MAX_WORDS_CHARS = 90

# (pattern over the first line, plain words; groups of the match fill {name}, {index}, ...)
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"tensor '(.+?)' size mismatch at index (\d+)\. expected (\d+), actual (\d+)"),
     "the size of {0} changed (dimension {1}: {2} -> {3})"),
    (re.compile(r"tensor '(.+?)' (?:stride|storage offset) mismatch"),
     "the memory layout of {0} changed"),
    (re.compile(r"tensor '(.+?)' requires_grad mismatch"),
     "requires_grad of {0} changed"),
    (re.compile(r"tensor '(.+?)' dtype mismatch"), "the dtype of {0} changed"),
    (re.compile(r"tensor '(.+?)' (?:device|dispatch key set) mismatch"),
     "the device or dispatch keys of {0} changed"),
    (re.compile(r"GLOBAL_STATE changed: (\w+)"), "global state changed ({0})"),
    (re.compile(r"\.training == (True|False)"), "a module switched between train and eval mode"),
    (re.compile(r"___check_obj_id|___check_type_id"), "a Python object the code depends on changed"),
    (re.compile(r"len\(.*\) == \d+"), "the length of a Python container changed"),
)
_FRIENDLY_STATE = {"grad_mode": "gradients were switched on or off"}


def summarize_guard_failure(reason: str) -> str:
    """A few plain words for one dynamo guard-failure reason."""
    first = reason.strip().splitlines()[0] if reason.strip() else ""
    first = re.sub(r"^\d+/\d+:\s*", "", first)  # the "frame/attempt:" compile id
    if not first:
        return "an unknown guard failed"
    for pattern, words in _PATTERNS:
        match = pattern.search(first)
        if match:
            if words.startswith("global state") and match.group(1) in _FRIENDLY_STATE:
                return _FRIENDLY_STATE[match.group(1)]
            return words.format(*match.groups())
    first = first.split("  #")[0].strip()  # drop dynamo's "# source line" comment
    return first if len(first) <= MAX_WORDS_CHARS else first[:MAX_WORDS_CHARS - 1] + "…"


def late_recompile_sentence(label: str, why: str, count: int) -> str:
    """One sentence for a recompile after warm-up at a shape already trained."""
    times = "" if count == 1 else f" ({count} times now)"
    return f"{label} recompiled after warm-up{times} because {why}."
