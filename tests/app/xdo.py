"""Real input for the window: xdotool moves the pointer, clicks and types on the X display, and
the window sees it as it sees a person (the walkthrough script and its test use this)."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any


def available() -> bool:
    return shutil.which("xdotool") is not None


def settle(app: Any, seconds: float = 0.3) -> None:
    """Let the window handle what arrived (and redraw) for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.update()
        time.sleep(0.02)


def _xdotool(*args: str) -> None:
    subprocess.run(["xdotool", *args], check=True, env=os.environ, timeout=30)


def move_to(x: int, y: int) -> None:
    """Put the pointer at (x, y). `mousemove --sync` waits for a motion event, so it is not sent
    when the pointer is already there (xdotool would then wait in vain)."""
    where = subprocess.run(["xdotool", "getmouselocation", "--shell"], check=True, env=os.environ,
                           timeout=30, capture_output=True, text=True).stdout
    at = dict(line.split("=", 1) for line in where.split() if "=" in line)
    if (at.get("X"), at.get("Y")) != (str(x), str(y)):
        _xdotool("mousemove", "--sync", str(x), str(y))


def centre(widget: Any) -> tuple[int, int]:
    return (widget.winfo_rootx() + widget.winfo_width() // 2,
            widget.winfo_rooty() + widget.winfo_height() // 2)


def click(app: Any, widget: Any, clicks: int = 1) -> None:
    """Move the pointer to the middle of `widget` and click it."""
    app.update()
    move_to(*centre(widget))
    _xdotool("click", "--repeat", str(clicks), "--delay", "60", "1")
    settle(app)


def scroll_into_view(app: Any, page: Any, widget: Any, stuck_after: int = 5) -> bool:
    """Turn the mouse wheel over `page` (a CTkScrollableFrame) until `widget` is in view; False
    when the page stops moving (`stuck_after` notches in a row) before it is."""
    canvas = page._parent_canvas
    still = 0
    while still < stuck_after:
        app.update()
        top, bottom = canvas.winfo_rooty(), canvas.winfo_rooty() + canvas.winfo_height()
        y = widget.winfo_rooty()
        if top <= y and y + widget.winfo_height() <= bottom:
            return True
        before = canvas.yview()
        move_to(*centre(canvas))
        _xdotool("click", "5" if y > top else "4")
        settle(app, 0.1)
        still = still + 1 if canvas.yview() == before else 0
    return False


def clear_and_type(app: Any, text: str) -> None:
    """In the focused entry: go to its end, delete what is there, type `text`."""
    _xdotool("key", "End")
    _xdotool("key", "--repeat", "40", "--delay", "5", "BackSpace")
    _xdotool("type", "--delay", "30", text)
    settle(app)


def screenshot(app: Any, path: Path) -> Path:
    """The whole screen, as the user sees it."""
    from PIL import ImageGrab
    settle(app, 0.4)
    ImageGrab.grab(bbox=(0, 0, app.winfo_screenwidth(), app.winfo_screenheight()),
                   xdisplay=os.environ["DISPLAY"]).save(path)
    return path
