#!/usr/bin/env python3
"""Train from a config file, headless: `python scripts/train.py --config FILE [--set k=v ...]`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from any folder

from modules.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
