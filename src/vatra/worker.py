"""One process per rank: ``torchrun -m vatra.worker CONFIG [--set k=v] [--run-dir DIR]``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vatra.config import load_config
from vatra.errors import VatraError
from vatra.rundir import RunDir


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
        rank = int(os.environ.get("RANK", "0"))
        said = False
        if args.run_dir is not None:  # the launcher prints one line for the whole group
            try:
                RunDir(Path(args.run_dir)).write_error(rank, str(err), err.exit_code)
                said = True
            except OSError:  # the run folder cannot take it (a full disk): say it here instead
                pass
        if not said and (err.exit_code != 2 or rank == 0):  # a config error: the same on every rank
            print(f"error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
