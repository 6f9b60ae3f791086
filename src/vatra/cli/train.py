"""``vatra train`` (the built-in worker), ``vatra run`` (a user's script) and ``vatra config show``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from vatra._extras import require
from vatra.cli.app import app
from vatra.config import Config, dump_toml, load_config
from vatra.errors import ConfigError, VatraError
from vatra.rundir import RunDir, new_run_id

if TYPE_CHECKING:
    from vatra.launch import LaunchSpec

SET_HELP = "Override a config value: section.key=value (repeatable)."

config_app = typer.Typer(rich_markup_mode=None, help="Inspect configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")

# torchrun's flags, shared by `vatra train` and `vatra run`
Nproc = Annotated[
    int | None, typer.Option("--nproc", help="Worker processes on this node (default dist.nproc).")
]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="Run folder (default runs/<name>-<time>).")]
MaxRestarts = Annotated[int, typer.Option("--max-restarts", help="Restart the worker group up to R times.")]
Nnodes = Annotated[str, typer.Option("--nnodes", help="Nodes: N or MIN:MAX (elastic).")]
RdzvEndpoint = Annotated[str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT of the rendezvous.")]
RdzvId = Annotated[str, typer.Option("--rdzv-id", help="Job id shared by all nodes.")]
RdzvConf = Annotated[list[str], typer.Option("--rdzv-conf", help="Rendezvous option key=value (repeatable).")]
NodeRank = Annotated[
    int | None, typer.Option("--node-rank", help="This node's rank; node 0 hosts the store.")
]
LocalAddr = Annotated[str | None, typer.Option("--local-addr", help="This node's address for workers.")]


@config_app.command("show")
def config_show(
    config: Path = typer.Argument(..., help="TOML config file."),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Print the fully resolved config (defaults filled in, overrides applied) as TOML."""
    print(dump_toml(load_config(config, set_)), end="")


def _kv(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--rdzv-conf {item!r}: expected key=value, e.g. is_host=1")
        out[key.strip()] = value.strip()
    return out


def _launch_spec(
    nproc: int,
    nnodes: str,
    rdzv_endpoint: str | None,
    rdzv_id: str,
    rdzv_conf: list[str],
    node_rank: int | None,
    local_addr: str | None,
    max_restarts: int,
) -> LaunchSpec:
    """torchrun's flags as a LaunchSpec, checked before anything is written."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: must be ≥ 1 (worker processes on this node)")
    from vatra.launch import LaunchSpec  # torch: imported once the arguments are valid

    spec = LaunchSpec(
        nproc=nproc,
        nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        rdzv_conf=_kv(rdzv_conf),
        node_rank=node_rank,
        local_addr=local_addr,
        max_restarts=max_restarts,
    )
    spec.launch_config()  # usage errors before anything is written
    return spec


@app.command()
def train(
    config: Path = typer.Argument(..., help="TOML config file, e.g. examples/digits.toml."),
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
    """Train a model on N local processes (or many nodes) through torch.distributed's elastic agent."""
    cfg = load_config(config, set_, run="train")
    launch_run(
        cfg,
        config,
        set_,
        nproc,
        run_dir,
        "vatra train",
        (nnodes, rdzv_endpoint, rdzv_id, rdzv_conf, node_rank, local_addr, max_restarts),
    )


def launch_run(
    cfg: Config,
    config: Path,
    set_: list[str],
    nproc: int | None,
    run_dir: Path | None,
    command: str,
    flags: tuple[str, str | None, str, list[str], int | None, str | None, int],
) -> None:
    """Run the built-in worker on ``cfg`` (loaded from ``config`` with ``set_``) under the elastic
    agent: ``vatra train``'s and ``vatra meta``'s launch. ``flags``: torchrun's (nnodes,
    rdzv_endpoint, rdzv_id, rdzv_conf, node_rank, local_addr, max_restarts)."""
    nnodes, rdzv_endpoint, rdzv_id, rdzv_conf, node_rank, local_addr, max_restarts = flags
    if nproc is not None:
        if nproc < 1:
            raise ConfigError(f"--nproc {nproc}: must be ≥ 1 (worker processes on this node)")
        cfg.dist.nproc = nproc
    spec = _launch_spec(
        cfg.dist.nproc, nnodes, rdzv_endpoint, rdzv_id, rdzv_conf, node_rank, local_addr, max_restarts
    )
    from vatra.launch import launch_workers
    from vatra.launch.forked import start
    from vatra.worker import forked_main, preload

    cfg = _preflight(cfg, cfg.dist.nproc if spec.nnodes == "1" else None)
    if cfg.resilience.live:
        from vatra.live.launcher import check_groups

        check_groups(cfg, cfg.dist.nproc, spec.nnodes)
    # each rank forked from a forkserver that imported vatra once; started now (the config is good),
    # it imports beside this process's run folder and rendezvous
    forked = (forked_main, preload(cfg))
    start(forked[1], cfg.dist.nproc)
    if run_dir is None and spec.nnodes != "1":
        launch_workers(spec, [str(config), *[a for s in set_ for a in ("--set", s)]], forked)
        return
    rd = RunDir(run_dir or Path(cfg.run.out_dir) / new_run_id(cfg.run.name)).create()
    with rd.lock(command, job=_job(spec)):  # held across the workers' elastic restarts
        rd.config.write_text(dump_toml(cfg))
        print(f"vatra: run folder {rd.path}", flush=True)
        try:
            if cfg.resilience.live:  # torchft replica groups, restarted one by one (vatra.live)
                from vatra.live.launcher import launch_live

                launch_live(cfg, rd, cfg.dist.nproc, spec.nnodes)
                return
            launch_workers(spec, [str(rd.config), "--run-dir", str(rd.path)], forked)
        except VatraError:
            if cfg.monitor.report and rd.metrics.exists():
                _report_after_failure(rd)
            raise


@app.command()
def run(
    script: Path = typer.Argument(
        ..., help="A Python script that calls vatra.fit (or any torch.distributed script)."
    ),
    script_args: list[str] = typer.Argument(None, help="Arguments for the script (after --)."),
    nproc: Nproc = None,
    run_dir: RunDirOpt = None,
    max_restarts: MaxRestarts = 0,
    nnodes: Nnodes = "1",
    rdzv_endpoint: RdzvEndpoint = None,
    rdzv_id: RdzvId = "vatra",
    rdzv_conf: RdzvConf = [],  # noqa: B006
    node_rank: NodeRank = None,
    local_addr: LocalAddr = None,
) -> None:
    """Run a user's script on N local processes (or many nodes) through the elastic agent.

    The script's own arguments follow --: vatra run train.py --nproc 2 -- --epochs 3. Every process
    gets torchrun's environment (RANK, WORLD_SIZE, ...) and VATRA_RUN_DIR, the one run folder that
    vatra.fit uses on every rank and after every restart (so a restarted group resumes).
    """
    if not script.is_file():
        raise ConfigError(f"script not found: {script} (pass a Python file, e.g. examples/custom_script.py)")
    spec = _launch_spec(
        nproc or 1, nnodes, rdzv_endpoint, rdzv_id, rdzv_conf, node_rank, local_addr, max_restarts
    )
    from vatra.api import RUN_DIR_ENV, RUN_STEM_ENV
    from vatra.launch import launch

    rd = RunDir(run_dir or Path("runs") / new_run_id(script.stem)).create()
    if run_dir is None:  # named after the script until its config names the run (vatra.fit moves it)
        os.environ[RUN_STEM_ENV] = script.stem
    try:
        with rd.lock("vatra run", job=_job(spec)):
            os.environ[RUN_DIR_ENV] = str(rd.path.resolve())
            print(f"vatra: run folder {rd.path}", flush=True)
            launch(spec, ["-u", str(script), *(script_args or [])], rd)
    finally:
        if rd.path.is_symlink():  # the link to the folder run.name named: needed only while it ran
            rd.path.unlink()


def _job(spec: LaunchSpec) -> str | None:
    """What the node launchers of one multi-node job share, so they may share a run folder (see
    :meth:`RunDir.lock`); None for a single-node job, which admits no second launcher."""
    from vatra.launch import parse_nnodes

    if parse_nnodes(spec.nnodes)[1] == 1:
        return None
    return f"{spec.rdzv_id}@{spec.rdzv_endpoint}"


def _preflight(cfg: Config, world: int | None = None) -> Config:
    """What can be checked once, here, before any worker starts: the config's import strings
    resolve, and a table's columns fit its files (schema only, no rows read); with the world size
    known (``world``, one node), per-rank lists and a learned balancer fit it. A Delta table is
    pinned to its latest version here when the config names none, so the run folder's config.toml
    says which version the run reads."""
    from vatra.registry import DATASETS, LOSSES, MODELS

    if world is not None:
        try:  # the workers' own checks, made once here so a mistake is one line before any starts
            async_servers = cfg.dist.servers if cfg.dist.mode == "async" else 0
            cfg.chaos.check_world_size(world - async_servers)  # per-rank lists name the workers
            if cfg.balance.batches or cfg.balance.method != "off":
                from vatra.engine.batches import balance_sizes  # torch: only when balancing

                balance_sizes(cfg.balance, world, cfg.train.batch_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if cfg.balance.method == "ppo":
            from vatra.balance.ppo import load_agent

            load_agent(cfg.balance.policy, world)
        if not cfg.parallel.is_default() and not cfg.parallel.auto:
            from vatra.config._parallel import check_world  # not vatra.parallel: no DTensor yet

            check_world(cfg.parallel, world)

    for registry, value in ((MODELS, cfg.model.name), (DATASETS, cfg.data.name), (LOSSES, cfg.train.loss)):
        if value != "auto" and not registry.is_builtin(value):
            registry.load_callable(value)
    if cfg.data.name == "table":
        from vatra.data import DataContext
        from vatra.data.tabular import check_table

        heads = {name: h.task for name, h in cfg.train.multitask.heads.items()}
        check_table(cfg.data, DataContext(seed=cfg.run.seed, task=cfg.train.task, head_tasks=heads))
    if cfg.data.name == "delta":
        require("deltalake", "delta", "data.name = 'delta'")
        from vatra.data.tables.source import pin

        return pin(cfg)
    return cfg


def _report_after_failure(rd: RunDir) -> None:
    """The run failed for good: write report.html from what the workers logged (best effort: the
    workers' failure is the error to show, not this one)."""
    from vatra.monitor.aftercare import report_after_training

    report_after_training(rd.path, None, rd.log_event)
