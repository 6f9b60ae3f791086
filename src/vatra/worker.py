"""One process per rank: ``torchrun -m vatra.worker CONFIG [--set k=v] [--run-dir DIR]``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from vatra.comm.plugin import CommPlugin
from vatra.config import Config, dump_toml, load_config
from vatra.engine import DistContext, Plugin, Trainer
from vatra.errors import VatraError
from vatra.monitor import (
    JsonlWriter,
    Monitor,
    ProgressDisplay,
    PrometheusExporter,
    StepTracer,
    TensorBoardWriter,
    TrainingFaults,
)
from vatra.resilience import CheckpointPlugin, KillInjector
from vatra.resilience.heal import Healer
from vatra.rundir import RunDir, new_run_id


def build_plugins(cfg: Config, run_dir: RunDir) -> list[Plugin]:
    """The plugins a config asks for, in dispatch order.

    Order matters: fault injection first (everything after it sees the fault), then
    communication, monitoring and healing, checkpointing; display and run-folder writers last
    so they record what the others added to the step's metrics.
    """
    plugins: list[Plugin] = []
    if TrainingFaults.wanted(cfg.chaos):
        plugins.append(TrainingFaults(cfg.chaos))
    if cfg.chaos.kill_at_steps:
        plugins.append(KillInjector(cfg.chaos, run_dir))
    plugins.append(CommPlugin(cfg.comm))
    if cfg.monitor.enabled:
        plugins.append(Monitor(cfg, run_dir))
    if cfg.heal.enabled:
        plugins.append(Healer(cfg))
    if cfg.monitor.prometheus_port is not None:
        plugins.append(PrometheusExporter(cfg.monitor))
    if cfg.monitor.tracing:
        plugins.append(StepTracer(cfg.monitor, run_dir.path))
    if cfg.checkpoint.enabled:
        plugins.append(CheckpointPlugin(cfg, run_dir))
    plugins.append(ProgressDisplay(cfg.run.progress, cfg.run.log_every))
    if cfg.run.tensorboard:
        plugins.append(TensorBoardWriter(run_dir, every=cfg.run.tb_every))
    plugins.append(JsonlWriter(run_dir))
    return plugins


def resolve_run_dir(cfg: Config, ctx: DistContext, given: str | None) -> RunDir:
    """``given``, or a new ``runs/<name>-<timestamp>`` chosen by rank 0 and shared with all ranks."""
    path = given or str(Path(cfg.run.out_dir) / new_run_id(cfg.run.name))
    path = str(ctx.broadcast_object(path))
    run_dir = RunDir(Path(path))
    if ctx.is_main:
        run_dir.create()
        run_dir.config.write_text(dump_toml(cfg))
    ctx.barrier()
    return run_dir


def run(cfg: Config, run_dir_arg: str | None) -> dict[str, object]:
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    ctx = DistContext.from_env(cfg.dist)
    try:
        run_dir = resolve_run_dir(cfg, ctx, run_dir_arg)
        trainer = Trainer.from_config(cfg, dist=ctx, plugins=build_plugins(cfg, run_dir), run_dir=run_dir)
        summary = trainer.fit()
        # Leave together: no rank tears down its connections while a peer is still in a collective.
        # (The abort at exit it was first added for is fixed in dist.release_process_groups.)
        ctx.barrier()
        return summary
    finally:
        ctx.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vatra.worker", description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        run(cfg, args.run_dir)
    except VatraError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
