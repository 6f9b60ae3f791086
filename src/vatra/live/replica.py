"""One replica group's process under live recovery: ``vatra.fit``'s assembly with a torchft manager.

The launcher (:mod:`vatra.live.launcher`) forks one per group and again for a group that died. The
process trains as a world of one (no torch.distributed process group: the gradients are averaged by
torchft over the groups in the quorum) that reads shard ``group`` of ``groups``. Group 0 writes the
run's records (metrics, summary, report, checkpoints); every group writes its events.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from vatra.assembly import build_plugins, prepare_run
from vatra.config import load_config
from vatra.engine import DistContext, Trainer
from vatra.errors import VatraError
from vatra.live.sync import LiveSync
from vatra.rundir import RunDir


def trainer_class(groups: int) -> type[Trainer]:
    """A :class:`Trainer` whose data is one of ``groups`` shards (its rank is the group)."""

    class GroupTrainer(Trainer):
        @property
        def data_world(self) -> int:
            return groups

    return GroupTrainer


def run(config: str, run_dir: str, group: int, groups: int, lighthouse: str, attempt: int) -> dict[str, Any]:
    """Train group ``group``'s share until ``train.steps``; the summary."""
    cfg = load_config(config)
    if group != 0:  # group 0 saves the checkpoints and runs the monitor; the others heal from a peer
        cfg.checkpoint.enabled = False
        cfg.monitor.enabled = False
    ctx = DistContext(rank=group, world_size=1)
    cfg, rd = prepare_run(cfg, ctx, run_dir)
    sync = LiveSync(cfg.resilience, group=group, groups=groups, lighthouse=lighthouse, attempt=attempt)
    trainer = trainer_class(groups).from_config(
        cfg, dist=ctx, plugins=build_plugins(cfg, rd, [sync]), run_dir=rd
    )
    return trainer.fit()


def main(environ: dict[str, str], argv: list[str]) -> None:
    """Forked by the launcher: ``argv`` = config, run folder, group, groups, lighthouse, attempt.
    Exits 0 when the group reached ``train.steps``; a vatra error is one line for the launcher."""
    from vatra.launch.forked import adopt

    adopt(environ)
    # torchft warns once per quorum that it cannot reset NCCL's flight recorder (gloo has none) and
    # logs a traceback per collective a dead peer broke (the launcher prints one line per death);
    # torch warns that a received state's buffer is read-only (it is loaded into the model by copy)
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    config, run_dir, group, groups, lighthouse, attempt = argv
    try:
        run(config, run_dir, int(group), int(groups), lighthouse, int(attempt))
    except VatraError as err:
        try:
            RunDir(Path(run_dir)).write_error(int(group), str(err), err.exit_code)
        except OSError:
            print(f"error: {err}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(err.exit_code)
    sys.stdout.flush()
    sys.stderr.flush()
    # torchft's threads (quorum, HTTP transport, the manager server) are not joined at exit
    os._exit(0)
