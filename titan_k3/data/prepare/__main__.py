"""``python -m titan_k3.data.prepare --config data.toml [--source NAME=PATH[:WEIGHT]] [--key value ...]``."""

from __future__ import annotations

import argparse
import sys

from titan_k3.config import split_overrides
from titan_k3.data.prepare.config import load_config
from titan_k3.data.prepare.pipeline import prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m titan_k3.data.prepare",
        description="Filter, deduplicate, decontaminate and tokenize text sources into shards.",
        epilog="Any config key can be set as --key value or --section.key value (e.g. --near_dedup.threshold 0.7).",
    )
    parser.add_argument("--config", help="TOML file (see titan_k3/data/prepare/config.py)")
    parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH[:WEIGHT]", help="add a source")
    parser.add_argument("--force", action="store_true", help="discard an existing or unfinished output and start over")
    args, rest = parser.parse_known_args(argv)
    try:
        overrides = dict(split_overrides(rest, form="--key value or --section.key value"))
    except ValueError as e:
        parser.error(str(e))
    try:
        cfg = load_config(args.config, overrides, args.source)
        prepare(cfg, force=args.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
