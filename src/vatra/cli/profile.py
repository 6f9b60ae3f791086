"""``vatra profile``: where the time of chosen training steps goes on every rank, and why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from vatra.cli.app import app
from vatra.cli.train import (
    SET_HELP,
    LocalAddr,
    MaxRestarts,
    Nnodes,
    NodeRank,
    Nproc,
    RdzvConf,
    RdzvEndpoint,
    RdzvId,
    RunDirOpt,
    launch_run,
)
from vatra.config import load_config
from vatra.config._monitor import profile_window
from vatra.errors import ConfigError, VatraError
from vatra.rundir import new_run_id

Flags = tuple[str, str | None, str, list[str], int | None, str | None, int]


@app.command()
def profile(
    config: Path = typer.Argument(..., help="TOML config file, e.g. examples/digits.toml."),
    steps: str = typer.Option(..., "--steps", help="Steps to profile, A:B (from 1, inclusive), e.g. 5:8."),
    fix: bool = typer.Option(
        False, "--fix", help="Apply the verdict's safe fixes, run the same steps again and compare."
    ),
    nproc: Nproc = None,
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: RunDirOpt = None,
    max_restarts: MaxRestarts = 0,
    nnodes: Nnodes = "1",
    rdzv_endpoint: RdzvEndpoint = None,
    rdzv_id: RdzvId = "vatra",
    rdzv_conf: RdzvConf = [],  # noqa: B006  (typer reads the default; it is never mutated)
    node_rank: NodeRank = None,
    local_addr: LocalAddr = None,
) -> None:
    """Profile steps A:B of a training run on every rank with torch.profiler: a trace of each rank
    and a merged trace.json in the run folder, each rank's time breakdown (data wait, forward,
    backward, exposed communication, optimizer, checkpoint, idle), a verdict with its evidence in
    profile.json, and with --fix the safe fixes measured again. The run stops after step B; the
    vatra train options apply."""
    cfg = load_config(config, set_, run="train")
    try:
        first, last = profile_window(steps)
    except ValueError as err:
        raise ConfigError(f"--steps {str(err).removeprefix('steps ')}") from None
    if last > cfg.train.steps:
        raise ConfigError(
            f"--steps {steps}: the run has train.steps = {cfg.train.steps}; profile steps within it "
            f"(e.g. --steps {min(first, cfg.train.steps)}:{cfg.train.steps})"
        )
    if fix and nnodes != "1":
        raise ConfigError("--fix re-runs the window on one node; profile a multi-node run without --fix")
    flags: Flags = (nnodes, rdzv_endpoint, rdzv_id, rdzv_conf, node_rank, local_addr, max_restarts)
    folder = run_dir or Path(cfg.run.out_dir) / new_run_id(cfg.run.name)
    from vatra.monitor.profile import analyse, format_report, profile_run

    def measure(overrides: list[str], where: Path) -> dict[str, Any]:
        """The window trained under the elastic agent as `vatra train` runs it, then its traces."""
        launch_run(
            load_config(config, overrides, run="train"),
            config,
            overrides,
            nproc,
            where,
            "vatra profile",
            flags,
        )
        if node_rank:  # node 0's launcher reads every rank's trace (the run folder is shared)
            print(f"vatra profile: node {node_rank}'s traces are in {where}; node 0 reads them all")
            raise typer.Exit(0)
        try:
            return analyse(where)
        except ValueError as err:
            raise VatraError(str(err)) from None

    report = profile_run(
        measure, cfg, set_, (first, last), folder, fix=fix, cuda=_cuda(), config_path=str(config)
    )
    print(format_report(report))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
