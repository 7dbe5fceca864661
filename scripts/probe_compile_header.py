"""Inductor's precompiled header and a warm start on a new CPU machine: one REGIONAL block of
the tiny SD 1.5 UNet compiled in fresh processes with the cache and temporary folders of each
case (cold; warm on the same or a new temporary folder; the header off; -O0):

    python scripts/probe_compile_header.py --out bench/header-probe

The cases: modules/bench/header_probe.py; what it found: docs/benchmarks.md ("Warm starts").
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modules.bench.header_probe import markdown, measure  # noqa: E402
from modules.bench.report import machine_info  # noqa: E402
from modules.paths import cache_dir_for  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="work folder (emptied first)")
    args = p.parse_args(argv)
    import shutil

    shutil.rmtree(args.out, ignore_errors=True)
    print(f"machine: {machine_info(ask_cuda=False)}")
    rows = measure(args.out, cache_dir_for(""))
    print(markdown(rows))
    print(f"load average at the end: {os.getloadavg()}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
