#!/usr/bin/env python3
"""A first-time user's walkthrough of the window, with real pointer and keyboard input.

    python scripts/walkthrough_ui.py [--out DIR] [--screens 1600x1000@100,1600x1000@150,1024x700@100]
                                     [--journey first|all|none]

First `tempera-ui` is launched as a user launches it, on the first screen's size
(app/first_paint.py, scripts/measure_first_paint.py): the first complete picture must be the
starting curtain with its line, then the complete form, never the form half built; the times
since the launch are printed and the pictures kept in DIR/launch/.
Each screen is a fresh virtual display (Xvfb) and fresh GUI settings with the demo preset; xdotool
drives the window. On each, first the start-up: while the training engine (torch) loads (held
back by the walkthrough until these checks are done) the window must be drawn, say that it loads,
keep Start greyed with the reason, and take a click on a tab and a typed value; once loaded,
Start must be free. Then the window and its Start / UI-scale controls must be on screen; every
tab is clicked and photographed, and its More options is reached with the wheel and opened by a
click (its fields must come into view) and photographed; a wrong value is typed into Batch size and the field below is clicked (the click
must land there); Start is clicked (the problem list must name the field by its
label); the problem is clicked (the field must be focused and in view); the value is fixed by
typing (the list must close). Then, on the first screen (--journey), the Continue journey with
the tiny built-in model: Start trains 2 steps to the end (the Run tab must say it finished and
offer no Resume), Max steps is typed up to 6 (the button must read Continue for 4 more steps),
Continue is clicked, Stop is clicked a step in (the Run tab must offer Resume from where it
stopped, and the curve must hold each step once), Resume is clicked and the run finishes at 6
(the curve must hold steps 1-6, each once, as run.json records them; no ETA left). Every check
prints ok or FAIL; the exit status is 1 when one failed. Pictures: DIR/<screen>/<step>.png (look at them). Needs Xvfb and xdotool
(scripts/ensure_xvfb.sh installs both).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
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


def drawn(widget) -> bool:
    """The widget's text is painted on the screen (dark pixels on a light page), not an empty
    grey box."""
    from PIL import ImageGrab
    x, y = widget.winfo_rootx(), widget.winfo_rooty()
    box = (x, y, x + widget.winfo_width(), y + widget.winfo_height())
    darkest, lightest = ImageGrab.grab(bbox=box, xdisplay=os.environ["DISPLAY"]).convert(
        "L").getextrema()
    return darkest < 100 < lightest


def wait_for(app, until, timeout: float) -> bool:
    """Let the window run until `until()` holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            return False
        app.update()
        time.sleep(0.05)
    return True


def start_up(app, check: Checks, gate: threading.Event, out: Path) -> None:
    """While the engine loads (held at `gate`): drawn, says so, Start waits, edits work."""
    from tests.app import xdo
    xdo.settle(app, 0.5)
    check(not app.engine_ready and app.run_panel.status_text.endswith(
        "Loading the training engine (torch)…"), "while torch loads, the status line says so")
    check(app.run_panel.buttons["start"].cget("state") == "disabled"
          and "still loading" in app.run_panel.button_tips["start"].text,
          "while torch loads, Start is greyed with the reason on hover")
    xdo.click(app, app.tabview._segmented_button._buttons_dict["Training"])
    steps = app.registry.find("training.max_steps")
    xdo.scroll_into_view(app, app.scroll_frames["Training"], steps.entry)
    check(app.tabview.get() == "Training" and drawn(steps.label),
          "while torch loads, a tab click shows the tab, its labels drawn")
    before = app.binding.config.training.max_steps
    xdo.click(app, steps.entry)
    xdo.clear_and_type(app, "123")
    check(app.binding.config.training.max_steps == 123 and not app.engine_ready,
          "while torch loads, a typed value reaches the settings")
    xdo.screenshot(app, out / "startup-loading.png")
    steps.var.set(str(before))
    gate.set()
    check(wait_for(app, lambda: app.engine.done, 180) and app.engine_ready
          and app.run_panel.buttons["start"].cget("state") == "normal",
          "once torch has loaded, Start is free")


def continue_journey(app, check: Checks, work: Path, out: Path) -> None:
    """Finish, raise Max steps, Continue, Stop, Resume, finish: the tiny model, real clicks."""
    from tests.app import xdo
    panel, resume, output = app.run_panel, app.run_panel.buttons["resume"], work / "run"
    for path, text in (("training.max_steps", "2"), ("training.batch_size", "1"),
                       ("sampling.every_steps", "0"), ("output.save_every_steps", "0"),
                       ("output.backup_every_steps", "1"), ("output.dir", str(output))):
        app.registry.find(path).var.set(text)
    xdo.click(app, panel.buttons["start"])
    finished = wait_for(app, lambda: app.runs.worker is None and app.runs.last_result, 600)
    if not check(finished and app.runs.last_result.status == "finished",
                 "Start trains the tiny model to its end (2 steps)"):
        print(panel.log_text()[-2000:])
        return
    check(resume.cget("state") == "disabled"
          and "finished at step 2" in panel.backups_label.cget("text"),
          "the Run tab says the run finished and offers no Resume")
    xdo.click(app, app.tabview._segmented_button._buttons_dict["Training"])
    steps = app.registry.find("training.max_steps")
    xdo.scroll_into_view(app, app.scroll_frames["Training"], steps.entry)
    xdo.click(app, steps.entry)
    xdo.clear_and_type(app, "6")
    check(resume.cget("text") == "Continue for 4 more steps" and resume.cget("state") == "normal",
          "typing Max steps 6 turns Resume into Continue for 4 more steps")
    xdo.click(app, resume)
    check(wait_for(app, lambda: len(panel.plot.steps) > 2 or app.runs.worker is None, 600),
          "Continue trains on")
    xdo.click(app, panel.buttons["stop"])
    wait_for(app, lambda: app.runs.worker is None, 600)
    record = json.loads((output / "run.json").read_text())
    stopped = record.get("step")
    check(record.get("status") == "stopped"
          and resume.cget("text") == f"Resume from step {stopped}",
          f"Stop a step in: the Run tab offers Resume from step {stopped}")
    check(panel.plot.steps == list(range(1, (stopped or 0) + 1)),
          f"after Stop the loss curve holds each step once: {panel.plot.steps}")
    xdo.screenshot(app, out / "journey-stopped.png")
    xdo.click(app, resume)
    wait_for(app, lambda: app.runs.worker is None, 600)
    record = json.loads((output / "run.json").read_text())
    check(app.runs.last_result is not None and app.runs.last_result.status == "finished"
          and record.get("step") == 6, "Resume finishes the run at step 6")
    check(panel.plot.steps == list(range(1, 7)) and panel.plot.losses == record.get("losses"),
          "the loss curve is run.json's, steps 1-6 each once")
    check("ETA" not in panel.step_label.cget("text"),
          f"no ETA once it finished: {panel.step_label.cget('text')!r}")
    xdo.screenshot(app, out / "journey-finished.png")


def walk(screen: str, out: Path, journey: bool = False) -> list[str]:
    """The walkthrough on one screen ("WxH@percent"), in this process; the failed checks."""
    from app.display import start_xvfb
    size, percent = screen.split("@")
    width, height = (int(v) for v in size.split("x"))
    xvfb, os.environ["DISPLAY"] = start_xvfb(f"{size}x24")
    try:
        from app.window import TemperaApp
        from modules import frontend
        from tests.app import xdo
        frontend.silence_library_noise()  # as tempera-ui does
        check = Checks()
        work = Path(tempfile.mkdtemp(prefix="tempera-walk-"))
        gate = threading.Event()  # the engine loads once the start-up checks are done

        def load_engine() -> None:
            gate.wait(120)
            frontend.load_engine()

        app = TemperaApp(settings_path=work / "ui.json", confirm=lambda title, message: True,
                         initial_preset=ROOT / "training_presets" / "demo.json",
                         load_engine=load_engine)
        try:
            if percent != "100":
                app.sizing.scale_menu._dropdown_callback(f"{percent}%")  # the menu's own command
            out.mkdir(parents=True, exist_ok=True)
            start_up(app, check, gate, out)
            app.tabview.set("General")
            xdo.settle(app, 1.0)
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
            if journey:
                continue_journey(app, check, work, out)
        finally:
            gate.set()
            app._finish_close()
        return check.failed
    finally:
        xvfb.terminate()


def first_paint(screen: str, out: Path) -> bool:
    """`tempera-ui` launched as a user launches it (scripts/measure_first_paint.py): the first
    complete picture is the starting curtain, then the complete form; the times are printed."""
    from app.first_paint import measure_first_paint
    result = measure_first_paint(screen)
    check = Checks()
    for ok, what in result.checks():
        check(ok, what)
    print("  " + result.summary(), flush=True)
    result.save_pictures(out)
    return not check.failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) /
                        "tempera-walkthrough")
    parser.add_argument("--screens", default=SCREENS,
                        help=f"comma-separated WxH@percent (default {SCREENS})")
    parser.add_argument("--journey", choices=("first", "all", "none"), default="first",
                        help="on which screens to train the Continue journey (default: the "
                             "first; it trains the tiny model, about a minute)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a single screen, in this process
    parser.add_argument("--with-journey", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from tests.app import xdo
    if not xdo.available():
        sys.exit("the walkthrough needs xdotool and Xvfb (bash scripts/ensure_xvfb.sh)")
    if args.one:
        return 1 if walk(args.one, args.out / args.one.replace("@", "-"),
                         args.with_journey) else 0
    failed = []
    first_screen = args.screens.split(",")[0].split("@")[0]
    print(f"launch on {first_screen}:", flush=True)
    if not first_paint(first_screen, args.out / "launch"):
        failed.append("launch")
    for index, screen in enumerate(args.screens.split(",")):
        print(f"{screen}:", flush=True)
        journey = args.journey == "all" or (args.journey == "first" and index == 0)
        # one process per screen: Tk and customtkinter's scaling are per process
        code = subprocess.call([sys.executable, __file__, "--out", str(args.out), "--one", screen]
                               + (["--with-journey"] if journey else []))
        if code:
            failed.append(screen)
    print(f"pictures in {args.out}")
    print("all checks passed" if not failed else "FAILED on " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
