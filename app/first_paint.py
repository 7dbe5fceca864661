"""What the screen shows from the launch of `tempera-ui` until its form is complete, watched from
outside the process (`scripts/measure_first_paint.py`; the walkthrough runs it).

A fresh virtual screen (Xvfb) and fresh GUI settings; `scripts/train_ui.py --config demo.json`
is started and the screen is photographed as fast as it can be (each distinct picture is kept
with its time since the launch). Each picture is one of: nothing yet (the screen's black),
a blank window (one colour), the starting curtain (`app.curtain`: its line of text, the
preset bar's place still empty), the form, complete (its upper part, the preset bar, the tabs
and the page, as in the settled window), or the form half drawn (anything else: frames without
labels). The status line and the run bar below are left out of the comparison: they change
when torch has loaded.

No tkinter here: only pictures of the screen.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageChops, ImageGrab

from app.display import start_xvfb

ROOT = Path(__file__).resolve().parent.parent
BLACK = (0, 0, 0)  # Xvfb's screen where no window is
FORM_PART = 0.6  # the upper share of the window compared with the settled form
TOP_BAND = 40  # px: where the preset bar is drawn (empty under the curtain)
LINE_HEIGHT = 60  # px: the curtain's line of text is no taller, at any UI scale
SETTLE_S = 3.0  # the form is settled once its upper part has not changed for this long


@dataclass
class Frame:
    """One distinct picture of the screen, `at` seconds after the launch."""
    at: float
    kind: str = ""  # nothing, blank, curtain, form, half drawn
    image: Any = None


@dataclass
class FirstPaint:
    """The pictures of one launch and what they say."""
    screen: str
    frames: list[Frame] = field(default_factory=list)
    load_before: float = 0.0  # the machine's 1-minute load average at the launch
    error: str = ""

    def first(self, kind: str) -> float | None:
        return next((f.at for f in self.frames if f.kind == kind), None)

    @property
    def window_s(self) -> float | None:
        """When the first window was on the screen (of any kind)."""
        return next((f.at for f in self.frames if f.kind != "nothing"), None)

    @property
    def complete_s(self) -> float | None:
        """When something complete was first on the screen: the curtain or the form."""
        return next((f.at for f in self.frames if f.kind in ("curtain", "form")), None)

    @property
    def reveal_s(self) -> float | None:
        """How long the form was seen partly drawn while it was uncovered (0.0 when it was
        never caught so), None when it never became complete."""
        form = self.first("form")
        if form is None:
            return None
        half = [f.at for f in self.frames if f.kind == "half drawn" and f.at < form]
        return form - half[0] if half else 0.0

    def kinds(self) -> list[str]:
        """The kinds seen, in order, each run of one kind once."""
        seen: list[str] = []
        for frame in self.frames:
            if not seen or seen[-1] != frame.kind:
                seen.append(frame.kind)
        return seen

    def checks(self) -> list[tuple[bool, str]]:
        """What must hold on any machine, however loaded (no timing): (held?, what)."""
        seen = " > ".join(self.kinds())
        return [
            (not self.error, "the window launched and settled"
             + (f": {self.error}" if self.error else "")),
            (bool(re.fullmatch(r"(nothing > )?(blank > )?curtain( > half drawn)? > form", seen)),
             f"first the starting curtain with its line, then the complete form, the form "
             f"never seen half built (seen: {seen})"),
        ]

    def save_pictures(self, folder: Path) -> None:
        """Each distinct picture as <seconds>-<kind>.png."""
        folder.mkdir(parents=True, exist_ok=True)
        for frame in self.frames:
            frame.image.save(folder / f"{frame.at:07.3f}-{frame.kind.replace(' ', '-')}.png")

    def summary(self) -> str:
        def at(value: float | None) -> str:
            return "never" if value is None else f"{value:.2f} s"
        return (f"{self.screen}: first window {at(self.window_s)}, curtain drawn "
                f"{at(self.first('curtain'))}, complete form {at(self.first('form'))} "
                f"(seen partly drawn for {at(self.reveal_s)} before); load average "
                f"{self.load_before:.1f} on {os.cpu_count()} CPUs; seen: "
                + " > ".join(self.kinds()))


def measure_first_paint(screen: str = "1024x700", timeout: float = 180.0,
                        preset: Path = ROOT / "training_presets" / "demo.json") -> FirstPaint:
    """Launch the window on a fresh `screen` ("WxH") and classify what the screen shows until
    the form has settled (or `timeout`)."""
    result = FirstPaint(screen, load_before=os.getloadavg()[0])
    xvfb, display = start_xvfb(f"{screen}x24")
    work = Path(tempfile.mkdtemp(prefix="tempera-paint-"))
    env = {**os.environ, "DISPLAY": display}
    log = work / "stderr.txt"  # a file, not a pipe: a full pipe would stall the window
    started = time.monotonic()
    with log.open("wb") as errors:
        app = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train_ui.py"),
                                "--settings", str(work / "ui.json"), "--config", str(preset)],
                               env=env, stdout=subprocess.DEVNULL, stderr=errors)
    try:
        last_hash, changed = "", started
        while time.monotonic() - started < timeout:
            image = ImageGrab.grab(xdisplay=display)
            now = time.monotonic()
            digest = hashlib.md5(image.tobytes()).hexdigest()
            if digest != last_hash:
                result.frames.append(Frame(now - started, image=image))
                last_hash, changed = digest, now
            elif (now - changed > SETTLE_S and len(result.frames) > 1
                  and _top_band_drawn(image)):
                break
            if app.poll() is not None:
                result.error = (f"the window's process ended ({app.returncode}): "
                                + log.read_text(errors="replace")[-2000:])
                break
            time.sleep(0.01)
        else:
            result.error = f"the form did not settle within {timeout:.0f} s"
    finally:
        app.terminate()
        try:
            app.wait(timeout=30)
        except subprocess.TimeoutExpired:
            app.kill()
        xvfb.terminate()
        shutil.rmtree(work)
    classify(result.frames)
    return result


def classify(frames: list[Frame]) -> None:
    """Name each frame's kind, the last one (the settled form) being the reference."""
    if not frames:
        return
    reference = _form_part(frames[-1].image)
    for frame in frames:
        frame.kind = _kind(frame.image, reference)


def _window_box(image: Any) -> tuple[int, int, int, int] | None:
    """Where the window is: what is not the screen's black."""
    return image.convert("L").point(lambda v: 255 if v else 0).getbbox()


def _form_part(image: Any) -> Any:
    box = _window_box(image)
    if box is None:
        return None
    left, top, right, bottom = box
    return image.crop((left, top, right, top + int((bottom - top) * FORM_PART)))


def _top_band_drawn(image: Any) -> bool:
    box = _window_box(image)
    if box is None:
        return False
    left, top, right, _ = box
    return _colours(image.crop((left, top, right, top + TOP_BAND))) > 1


def _one_line(window: Any) -> bool:
    """All but the window's background is one line of text (the curtain's), below its top."""
    counts = window.getcolors(maxcolors=1 << 16) or []
    if not counts:
        return False
    background = max(counts)[1]
    flat = Image.new("RGB", window.size, background)
    drawn = ImageChops.difference(window.convert("RGB"), flat).getbbox()
    return drawn is not None and drawn[1] >= TOP_BAND and drawn[3] - drawn[1] <= LINE_HEIGHT


def _colours(image: Any) -> int:
    return len(image.getcolors(maxcolors=1 << 16) or range(1 << 16))


def _kind(image: Any, reference: Any) -> str:
    box = _window_box(image)
    if box is None:
        return "nothing"
    window = image.crop(box)
    if _colours(window) == 1:
        return "blank"
    if _one_line(window):
        return "curtain"
    part = _form_part(image)
    if reference is not None and part.size == reference.size and part.tobytes() == reference.tobytes():
        return "form"
    return "half drawn"
