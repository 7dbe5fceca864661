#!/usr/bin/env python3
"""Show what torch.compile would make of a config's components: graphs, breaks, decisions.

`python scripts/explain_compile.py --config FILE [--set k=v ...] [--json]`
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from any folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = parser.parse_args(argv)
    from modules.config import ConfigError, apply_overrides, load_config
    from modules.train.setup.explain_run import explain_config, explain_text
    try:
        config = apply_overrides(load_config(args.config), args.overrides)
        print(json.dumps(explain_config(config), indent=2, default=str) if args.json
              else explain_text(config))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
