#!/usr/bin/env python3
"""What stochastic rounding buys for bfloat16 weights on the tiny model (docs/memory.md,
"Fused backward"): `python scripts/measure_stochastic_rounding.py [--steps 20] [--lr 1e-5]`."""
import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modules.bench.stochastic_rounding import measure  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tempera")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tempera-sr-") as work:
        print(json.dumps(measure(args.cache, Path(work), args.steps, args.lr), indent=2))
