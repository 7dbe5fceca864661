#!/usr/bin/env python3
"""Generate docs/config.md from the config schema: `python scripts/gen_config_docs.py [--check]`."""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from any folder

from modules.config.docs import DOC_PATH, update_config_reference  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the committed file is out of date")
    args = parser.parse_args()
    path = ROOT / DOC_PATH
    up_to_date = update_config_reference(path, check=args.check)
    if up_to_date:
        print(f"{DOC_PATH} is up to date")
        return 0
    if args.check:
        print(f"{DOC_PATH} is out of date; run: python scripts/gen_config_docs.py",
              file=sys.stderr)
        return 1
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
