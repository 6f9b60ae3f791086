"""One process per rank: ``torchrun -m vatra.worker CONFIG [--set k=v] [--run-dir DIR]``."""

from __future__ import annotations

import argparse
import sys

from vatra.config import load_config
from vatra.errors import VatraError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vatra.worker", description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from vatra.api import fit  # torch: once the config is valid

        fit(cfg, run_dir=args.run_dir)
    except VatraError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
