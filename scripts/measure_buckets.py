"""Aspect-ratio buckets under compilation: compile time and recompiles per scope x dynamic.

    python scripts/measure_buckets.py --out bucket-out

Each setting trains the tiny model in its own process; see docs/compilation.md. The logic lives
in modules/bench/buckets.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modules.bench.buckets import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
