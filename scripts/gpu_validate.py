"""GPU validation, one phase per command: ``python scripts/gpu_validate.py --list``.

See docs/gpu.md; the logic lives in modules/bench/gpu_*.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modules.bench.gpu_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
