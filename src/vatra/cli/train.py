"""``vatra train`` and ``vatra config show``."""

from __future__ import annotations

from pathlib import Path

import typer

from vatra.cli.app import app
from vatra.config import dump_toml, load_config
from vatra.errors import ConfigError, VatraError
from vatra.rundir import RunDir, new_run_id

SET_HELP = "Override a config value: section.key=value (repeatable)."

config_app = typer.Typer(help="Inspect configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")


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


@app.command()
def train(
    config: Path = typer.Argument(..., help="TOML config file, e.g. examples/digits.toml."),
    nproc: int | None = typer.Option(
        None, "--nproc", help="Worker processes on this node (default dist.nproc)."
    ),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Run folder (default runs/<name>-<time>)."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="Restart the worker group up to R times."),
    nnodes: str = typer.Option("1", "--nnodes", help="Nodes: N or MIN:MAX (elastic)."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous."),
    rdzv_id: str = typer.Option("vatra", "--rdzv-id", help="Job id shared by all nodes."),
    rdzv_conf: list[str] = typer.Option([], "--rdzv-conf", help="Rendezvous option key=value (repeatable)."),
    node_rank: int | None = typer.Option(
        None, "--node-rank", help="This node's rank; node 0 hosts the store."
    ),
    local_addr: str | None = typer.Option(None, "--local-addr", help="This node's address for workers."),
) -> None:
    """Train a model on N local processes (or many nodes) through torch.distributed's elastic agent."""
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc {nproc}: must be ≥ 1 (worker processes on this node)")
    cfg = load_config(config, set_)
    if nproc is not None:
        cfg.dist.nproc = nproc
    from vatra.launch import LaunchSpec, launch_workers  # torch: imported once the config is valid

    spec = LaunchSpec(
        nproc=cfg.dist.nproc,
        nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        rdzv_conf=_kv(rdzv_conf),
        node_rank=node_rank,
        local_addr=local_addr,
        max_restarts=max_restarts,
    )
    spec.launch_config()  # usage errors before anything is written
    multi_node = spec.nnodes != "1"
    if run_dir is None and multi_node:
        launch_workers(spec, [str(config), *[a for s in set_ for a in ("--set", s)]])
        return
    rd = RunDir(run_dir or Path(cfg.run.out_dir) / new_run_id(cfg.run.name)).create()
    rd.config.write_text(dump_toml(cfg))
    print(f"vatra: run folder {rd.path}", flush=True)
    try:
        launch_workers(spec, [str(rd.config), "--run-dir", str(rd.path)])
    except VatraError:
        if cfg.monitor.report and rd.metrics.exists():
            _report_after_failure(rd)
        raise


def _report_after_failure(rd: RunDir) -> None:
    """The run failed for good: write report.html from what the workers logged (best effort)."""
    from vatra.monitor.report import write_report  # matplotlib: only when a report is made

    try:
        write_report(rd.path)
    except Exception as err:  # the workers' failure is the error to show, not this one
        print(f"vatra: could not write the report: {type(err).__name__}: {err}", flush=True)
