"""Issue 55 item 3's probe: one REGIONAL block of the tiny SD 1.5 UNet compiled ahead of time,
saved, and loaded in fresh processes, against the usual compile, cold and warm:

    python scripts/probe_aot_compile.py --out bench/aot-probe [--backend inductor] [--block mlp]

The logic and what each row means: modules/bench/aot_probe.py; what it found: docs/compilation.md.
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modules.bench.aot_probe import BLOCKS, markdown, measure  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="work folder")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--block", default="transformer", choices=BLOCKS,
                   help="the UNet's BasicTransformerBlock, or a Linear-GELU-Linear block")
    args = p.parse_args(argv)
    rows = measure(args.out, args.backend, args.block)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(markdown(rows, args.backend, args.block))
    print(f"load average at the end: {load}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
