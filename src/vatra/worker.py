"""One process per rank: ``torchrun -m vatra.worker CONFIG [--set k=v] [--run-dir DIR]``."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from vatra.config import Config, load_config
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
    except Exception as err:
        if args.run_dir is None or not peer_lost(err):
            raise
        # Another rank went away mid-collective (killed, or stopped by its own error): the launcher
        # names that rank; this rank's traceback would only bury the one line that says why.
        rank = int(os.environ.get("RANK", "0"))
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        RunDir(Path(args.run_dir)).write_error(rank, f"lost a peer: {first}", 1, peer_lost=True)
        return 1
    return 0


def preload(cfg: Config) -> list[str]:
    """What the launcher's forkserver imports once (vatra.launch.forked), so that no rank pays for it
    again: the worker and the training stack; ``torch._dynamo``, which every optimizer's constructor
    imports (~0.9 s of CPU); TensorBoard's writer when the run writes TensorBoard (~0.2 s). The
    report's matplotlib stays with rank 0, which alone draws it at the end."""
    modules = ["vatra.worker", "vatra.api", "torch._dynamo"]
    if cfg.run.tensorboard:
        modules.append("torch.utils.tensorboard")
    if cfg.resilience.live:  # torchft: its import is most of a restarted replica group's start
        modules += ["vatra.live.replica", "torchft"]
        # torchft's Rust side logs every quorum and commit at INFO; it reads the level at import
        os.environ.setdefault("RUST_LOG", "warn")
    return modules


def forked_main(environ: dict[str, str], argv: list[str]) -> None:
    """:func:`main` in a rank forked by ``vatra train``'s launcher; exits with its code."""
    from vatra.launch.forked import adopt

    adopt(environ)
    code = main(argv)
    if code:
        sys.exit(code)


_PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|Connection refused|connection was closed", re.I
)


def peer_lost(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because a peer process went away (gloo's and the
    TCP store's socket errors), rather than a fault of this rank's own."""
    import torch.distributed as dist

    return isinstance(err, RuntimeError | dist.DistError) and bool(_PEER_LOST.search(str(err)))


if __name__ == "__main__":
    sys.exit(main())
