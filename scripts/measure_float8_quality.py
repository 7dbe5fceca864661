#!/usr/bin/env python3
"""What 8-bit weight storage costs in quality on the tiny model (docs/memory.md): a LoRA
trained on the float8- (or int8-, or W8A8-) stored base against one on the unquantized base, same seed
and data: `python scripts/measure_float8_quality.py [--steps 60] [--weight-dtype BFLOAT16]
[--storage INT8|W8A8]`."""
import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modules.bench.float8_quality import measure  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--weight-dtype", default="BFLOAT16", choices=["BFLOAT16", "FLOAT32"])
    parser.add_argument("--storage", default="FLOAT8", choices=["FLOAT8", "INT8", "W8A8"])
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "tempera")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tempera-float8-") as work:
        print(json.dumps(measure(args.cache, Path(work), args.steps, args.weight_dtype,
                                 args.storage), indent=2))
