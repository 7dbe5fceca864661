#!/usr/bin/env python3
"""Dataset preparation: `python scripts/data.py caption FOLDER ...` (the same as tempera-data)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from any folder

from modules.cli.data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
