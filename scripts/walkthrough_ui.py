#!/usr/bin/env python3
"""A first-time user's walkthrough of the window, with real pointer and keyboard input.

    python scripts/walkthrough_ui.py [--out DIR] [--screens 1600x1000@100,1600x1000@150,1024x700@100]

Each screen is a fresh virtual display (Xvfb) and fresh GUI settings with the demo preset; xdotool
drives the window. On each: the window and its Start / UI-scale controls must be on screen; every
tab is clicked and photographed, and its More options is reached with the wheel and opened by a
click (its fields must come into view) and photographed; a wrong value is typed into Batch size and the field below is clicked (the click
must land there); Start is clicked (the problem list must name the field by its
label); the problem is clicked (the field must be focused and in view); the value is fixed by
typing (the list must close). Every check prints ok or FAIL; the exit status is 1 when one
failed. Pictures: DIR/<screen>/<step>.png (look at them). Needs Xvfb and xdotool
(scripts/ensure_xvfb.sh installs both).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from any folder

SCREENS = "1600x1000@100,1600x1000@150,1024x700@100"


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str) -> bool:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            self.failed.append(what)
        return ok


def inside(widget, width: int, height: int) -> bool:
    """The whole widget is on a screen of this size (and drawn)."""
    x, y = widget.winfo_rootx(), widget.winfo_rooty()
    return (widget.winfo_ismapped() and x >= 0 and y >= 0
            and x + widget.winfo_width() <= width and y + widget.winfo_height() <= height)


def walk(screen: str, out: Path) -> list[str]:
    """The walkthrough on one screen ("WxH@percent"), in this process; the failed checks."""
    from app.display import start_xvfb
    size, percent = screen.split("@")
    width, height = (int(v) for v in size.split("x"))
    xvfb, os.environ["DISPLAY"] = start_xvfb(f"{size}x24")
    try:
        from app.window import TemperaApp
        from tests.app import xdo
        check = Checks()
        work = Path(tempfile.mkdtemp(prefix="tempera-walk-"))
        app = TemperaApp(settings_path=work / "ui.json", confirm=lambda title, message: True,
                         initial_preset=ROOT / "training_presets" / "demo.json")
        try:
            if percent != "100":
                app.sizing.scale_menu._dropdown_callback(f"{percent}%")  # the menu's own command
            xdo.settle(app, 1.0)
            out.mkdir(parents=True, exist_ok=True)
            check(inside(app, width, height), f"the window fits the {size} screen")
            for name, widget in (("Start training", app.run_panel.buttons["start"]),
                                 ("UI scale", app.sizing.scale_menu), ("Stop", app.run_panel.buttons["stop"])):
                check(inside(widget, width, height), f"{name} is on screen")
            for tab, button in app.tabview._segmented_button._buttons_dict.items():
                xdo.click(app, button)
                check(app.tabview.get() == tab, f"clicking the {tab} tab shows it")
                name = tab.lower().replace(" ", "-")
                xdo.screenshot(app, out / f"tab-{name}.png")
                for more in {m for path, m in app.registry.more_of.items()
                             if app.registry.tab_of[path] == tab}:
                    reached = xdo.scroll_into_view(app, app.scroll_frames[tab], more.button)
                    check(reached, f"{tab}: the mouse wheel reaches More options")
                    if not reached:
                        continue
                    xdo.click(app, more.button)
                    canvas = app.scroll_frames[tab]._parent_canvas
                    first = min(more.bodies, key=lambda body: body.winfo_rooty())
                    check(more.expanded and first.winfo_rooty() + 40
                          < canvas.winfo_rooty() + canvas.winfo_height(),
                          f"{tab}: a click opens More options, its fields in view")
                    xdo.screenshot(app, out / f"tab-{name}-more.png")
                    xdo.click(app, more.button)

            app.tabview.set("Training")
            xdo.settle(app)
            batch = app.registry.find("training.batch_size")
            below = app.registry.find("training.gradient_accumulation")
            page = app.scroll_frames["Training"]
            check(xdo.scroll_into_view(app, page, batch.frame)
                  and xdo.scroll_into_view(app, page, below.frame),
                  "the mouse wheel scrolls the Training tab to Batch size and the field below")
            xdo.click(app, batch.entry)
            xdo.clear_and_type(app, "four")
            if not check(batch.error is not None,
                         "typing 'four' into Batch size shows an error there"):
                return check.failed  # Start would train the demo: nothing more to see
            xdo.click(app, below.entry)
            check(app.focus_get() is below.entry._entry,
                  "the click on the field below lands in that field")
            xdo.screenshot(app, out / "inline-error.png")

            xdo.click(app, app.run_panel.buttons["start"])
            texts = [b.cget("text") for b in app.problems_panel.buttons]
            check(any("Training › Batch size" in t for t in texts),
                  "Start lists the problem by its label (Training › Batch size)")
            xdo.screenshot(app, out / "problems.png")
            app.tabview.set("General")
            xdo.settle(app)
            button = next((b for b in app.problems_panel.buttons if "Batch size" in b.cget("text")), None)
            if check(button is not None and inside(button, width, height),
                     "the problem is on screen to click"):
                xdo.click(app, button)
                canvas = app.scroll_frames["Training"]._parent_canvas
                top = canvas.winfo_rooty()
                check(app.focus_get() is batch.entry._entry
                      and top <= batch.frame.winfo_rooty() < top + canvas.winfo_height(),
                      "clicking it shows Batch size, focused, in view")
            xdo.clear_and_type(app, "1")
            xdo.settle(app, 1.0)
            check(app.problems_panel.frame.winfo_manager() == "",
                  "fixing the value closes the problem list")
            check(inside(app.run_panel.status, width, height)
                  and "\n" not in app.run_panel.status.cget("text"),
                  f"the status line is one line on screen: {app.run_panel.status.cget('text')!r}")
            xdo.screenshot(app, out / "fixed.png")
        finally:
            app._finish_close()
        return check.failed
    finally:
        xvfb.terminate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) /
                        "tempera-walkthrough")
    parser.add_argument("--screens", default=SCREENS,
                        help=f"comma-separated WxH@percent (default {SCREENS})")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a single screen, in this process
    args = parser.parse_args()
    from tests.app import xdo
    if not xdo.available():
        sys.exit("the walkthrough needs xdotool and Xvfb (bash scripts/ensure_xvfb.sh)")
    if args.one:
        return 1 if walk(args.one, args.out / args.one.replace("@", "-")) else 0
    failed = []
    for screen in args.screens.split(","):
        print(f"{screen}:", flush=True)
        # one process per screen: Tk and customtkinter's scaling are per process
        code = subprocess.call([sys.executable, __file__, "--out", str(args.out), "--one", screen])
        if code:
            failed.append(screen)
    print(f"pictures in {args.out}")
    print("all checks passed" if not failed else "FAILED on " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
