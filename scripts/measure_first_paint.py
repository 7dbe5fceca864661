#!/usr/bin/env python3
"""How long `tempera-ui` takes to show a complete window: `python scripts/measure_first_paint.py
[--screen 1024x700] [--runs 3] [--out DIR]`.

Each run launches the window on a fresh virtual screen and prints when the first window, the
drawn starting curtain and the complete form were on the screen (seconds since the launch), how
long the form was seen partly drawn, and the machine's load (app/first_paint.py says how the
pictures are read); it exits 1 when a run saw anything but the curtain, then the complete form
(the form half built, a run that never settled). --out keeps each run's distinct pictures.
Needs Xvfb.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from any folder

from app.first_paint import measure_first_paint  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--screen", default="1024x700", help="WxH of the virtual screen")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, help="a folder for each run's pictures")
    args = parser.parse_args()
    failed = False
    for run in range(args.runs):
        result = measure_first_paint(args.screen)
        print(result.summary(), flush=True)
        for ok, what in result.checks():
            if not ok:
                print("  FAIL", what)
                failed = True
        if args.out:
            result.save_pictures(args.out / f"run{run + 1}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
