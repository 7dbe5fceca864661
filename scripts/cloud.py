#!/usr/bin/env python3
"""Push-to-train cloud runs: `python scripts/cloud.py {init,install-hook,push-and-train,status,...}`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from any folder

from modules.cloud.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
