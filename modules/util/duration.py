"""How long something takes, in the words every front end prints (CLI, GUI, cloud status)."""
from __future__ import annotations


def format_duration(seconds: float | None) -> str:
    """`5:52` or `1:05:52`; `?` when the duration is unknown (None, NaN or negative)."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
