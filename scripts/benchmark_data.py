#!/usr/bin/env python3
"""Scan, bucket and latent-cache speed and memory from 1k to 20k images, into docs/benchmarks.md:
`python scripts/benchmark_data.py [--sizes 1000,5000,20000] [--work /tmp/tempera-data-scale]`."""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from modules.bench.data_scale import run, write_docs  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1000,5000,20000")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tempera-data-scale"))
    parser.add_argument("--kill-after", type=float, default=60.0,
                        help="seconds after its start to kill the largest cache build")
    parser.add_argument("--cache-up-to", type=int, default=1000,
                        help="measure latent caching for sizes up to this many images")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    result = run([int(s) for s in args.sizes.split(",")], args.work, args.kill_after,
                 args.cache_up_to)
    print(json.dumps(result, indent=2))
    write_docs(result, args.docs)
    print(f"wrote {args.docs}")
