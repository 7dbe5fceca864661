#!/usr/bin/env python3
"""Open the Tempera window: `python scripts/train_ui.py [--config FILE]`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from any folder

from app.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
