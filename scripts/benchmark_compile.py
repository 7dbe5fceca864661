"""The benchmark's one command line, two subcommands (``matrix`` is the default):

    python scripts/benchmark_compile.py [matrix] --model tiny --resolution 64 --batch 4 \
        --backends NONE,AOT_EAGER,INDUCTOR --scopes REGIONAL --dynamic STATIC --out bench-out
    python scripts/benchmark_compile.py buckets --device cuda --out bucket-out

See docs/benchmarks.md; the logic lives in modules/bench/.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modules.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
