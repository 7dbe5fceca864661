#!/usr/bin/env python3
"""Screenshots of every tab for docs/gui.md: `python scripts/screenshot_ui.py [--out docs/images]`.

Uses $DISPLAY, or starts its own Xvfb when there is none, with the window at 1280x860. With
--train-steps N (default 6) it also trains the demo preset for N steps so the Run tab shows a
loss curve and a sample. `--screen 1366x768@150` photographs the window as it opens on a screen
of that size at that UI scale instead (its own Xvfb of that size; the whole screen is taken).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from any folder

TABS = {"General": "gui-general.png", "Model": "gui-model.png", "Data": "gui-data.png",
        "Training": "gui-training.png", "Sampling": "gui-sampling.png",
        "Advanced Options": "gui-advanced.png", "Cloud": "gui-cloud.png"}


def ensure_display(screen: str | None = None) -> subprocess.Popen | None:
    """$DISPLAY, or an Xvfb of its own (always one of `screen`'s size: "WxH")."""
    if os.environ.get("DISPLAY") and screen is None:
        return None
    if not shutil.which("Xvfb"):
        sys.exit("no DISPLAY and no Xvfb (apt-get install xvfb)")
    from app.display import start_xvfb
    proc, os.environ["DISPLAY"] = start_xvfb(f"{screen}x24" if screen else "1400x950x24")
    return proc


def settle(app, seconds: float = 0.4) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.update()
        time.sleep(0.02)


def grab(app, path: Path, whole_screen: bool = False) -> None:
    from PIL import ImageGrab
    settle(app)
    x, y = app.winfo_rootx(), app.winfo_rooty()
    box = (x, y, x + app.winfo_width(), y + app.winfo_height())
    if whole_screen:
        box = (0, 0, app.winfo_screenwidth(), app.winfo_screenheight())
    ImageGrab.grab(bbox=box, xdisplay=os.environ["DISPLAY"]).save(path)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--train-steps", type=int, default=6,
                        help="train the demo this many steps for the Run tab (0: skip)")
    parser.add_argument("--screen", help="WxH@percent: the window as it opens on such a screen")
    args = parser.parse_args()
    screen, percent = args.screen.split("@") if args.screen else (None, "100")
    xvfb = ensure_display(screen)
    args.out.mkdir(parents=True, exist_ok=True)
    from app.window import TemperaApp
    work = Path(tempfile.mkdtemp(prefix="tempera-shots-"))
    app = TemperaApp(settings_path=work / "ui.json", confirm=lambda title, message: True,
                     initial_preset=ROOT / "training_presets" / "demo.json")
    if screen is None:
        app.geometry("1280x860+0+0")
    elif percent != "100":
        app.sizing.scale_menu._dropdown_callback(f"{percent}%")  # the menu's own command
    try:
        while not app.engine.done:  # torch loads in a thread; the plan's line needs it
            settle(app, 0.2)
        app.compile_panel.backend.menu._dropdown_callback("INDUCTOR")
        cloud = app.cloud_panel  # example locations, so the Cloud tab shows what goes where
        for entry, text in ((cloud.entries["cloud_repo"], "~/cats-training"),
                            (cloud.entries["cloud_status"], "me@gpu-box:/srv/tempera-work"),
                            (cloud.name_entry, "cats-v1")):
            cloud.set_entry(entry, text)
        for tab, name in TABS.items():
            app.tabview.set(tab)
            grab(app, args.out / name, whole_screen=screen is not None)
        app.registry.find("training.batch_size").var.set("four")
        app.registry.find("data.resolution").var.set("100")
        app.runs.start()
        app.tabview.set("Training")
        grab(app, args.out / "gui-problems.png", whole_screen=screen is not None)
        app.registry.find("training.batch_size").var.set("1")
        app.registry.find("data.resolution").var.set("64")
        app.problems_panel.hide()
        if args.train_steps:
            app.compile_panel.backend.menu._dropdown_callback("NONE")
            for path, text in (("training.max_steps", str(args.train_steps)),
                               ("sampling.every_steps", "0"), ("sampling.steps", "10"),
                               ("output.save_every_steps", "0"),
                               ("output.dir", str(work / "output"))):
                app.registry.find(path).var.set(text)
            app.runs.start()
            while app.runs.worker is not None:
                settle(app, 0.2)
        app.tabview.set("Run")
        grab(app, args.out / "gui-run.png", whole_screen=screen is not None)
    finally:
        app._finish_close()
        if xvfb is not None:
            xvfb.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
