"""`tempera-ui` / `scripts/train_ui.py`: open the Tempera window."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tempera-ui", description="Open the Tempera window.")
    parser.add_argument("--config", type=Path, help="preset/config JSON to open")
    parser.add_argument("--settings", type=Path,
                        help="GUI settings file (default ~/.config/tempera/ui.json)")
    args = parser.parse_args(argv)
    from modules.frontend import silence_torchvision_fallback_warnings
    silence_torchvision_fallback_warnings()  # a warning about a package we never use
    try:
        from app.window import TemperaApp
        app = TemperaApp(settings_path=args.settings, initial_preset=args.config)
    except Exception as exc:  # e.g. no display: say so instead of a bare Tcl traceback
        if type(exc).__name__ == "TclError":
            print(f"tempera-ui: cannot open a window: {exc} (is DISPLAY set?)", file=sys.stderr)
            return 1
        raise
    app.mainloop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
