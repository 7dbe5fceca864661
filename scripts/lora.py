#!/usr/bin/env python3
"""LoRA tools: `python scripts/lora.py {merge,merge-loras,extract,resize,convert} ...`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from any folder

from modules.cli.lora import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
