"""How warm a fresh process starts: (a) empty cache, (b) local cache, (c) a bundle only, in
another cache folder, home and checkout copy, (d₀) compile ahead with the data cached, and with
--images N, (b′) local cache and (d) compile ahead on N uncached images, for the tiny SD 1.5
and Z-Image models, REGIONAL and FULL, in one run:

    python scripts/measure_warm_start.py --out bench/warm-start --images 4000

See docs/benchmarks.md ("Warm starts"); the logic lives in modules/bench/warm_start.py.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modules.bench.warm_start import MODELS, SCOPES, measure_warm_start  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--backend", default="DEFAULT",
                   help="compile backend (default DEFAULT: inductor without max_autotune)")
    p.add_argument("--models", default=",".join(MODELS), help="comma list of built-in models")
    p.add_argument("--scopes", default=",".join(SCOPES), help="comma list of scopes")
    p.add_argument("--steps", type=int, default=4, help="timed steps per process")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    p.add_argument("--cache-dir", help="general.cache_dir (built models, datasets)")
    p.add_argument("--images", type=int, default=0,
                   help="add (b') and (d): both start on this many uncached images (0: off)")
    args = p.parse_args(argv)
    result = measure_warm_start(args.out, backend=args.backend,
                                models=args.models.split(","), scopes=args.scopes.split(","),
                                steps=args.steps, timeout=args.timeout,
                                cache_dir=args.cache_dir, images=args.images)
    print(result.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
