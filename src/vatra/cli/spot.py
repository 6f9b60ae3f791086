"""``vatra spot simulate CONFIG``: what a job costs on spot nodes under each policy, from price traces."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from vatra.cli.app import app
from vatra.errors import ConfigError

spot_app = typer.Typer(
    rich_markup_mode=None,
    help="Spot machines: simulate what a job costs under each checkpoint and migration policy.",
    no_args_is_help=True,
)
app.add_typer(spot_app, name="spot")


@spot_app.command("simulate")
def spot_simulate(
    config: Path = typer.Argument(..., help="The simulator's TOML (job, fleet, world, policy, traces)."),
    trace: Path | None = typer.Option(
        None, "--trace", help="Price trace (AWS, GCP or Azure); overrides traces.prices."
    ),
    interruptions: Path | None = typer.Option(
        None,
        "--interruptions",
        help="Spot Advisor buckets or observed events; overrides traces.interruptions.",
    ),
    out: Path = typer.Option(
        Path("runs/spot-simulate"), "--out", help="Folder for results.json and policies.png."
    ),
) -> None:
    """Simulate the job under on-demand, spot with a fixed checkpoint interval, spot with Young/Daly's
    interval, and spot with prediction, migration and autoscaling; print cost, completion time,
    lost work and restarts of each, and write them as JSON and a plot."""
    from vatra.cost.sim.config import load_sim_config, resolve
    from vatra.cost.sim.report import table, write
    from vatra.cost.sim.simulate import Setup, as_json, simulate, trace_names
    from vatra.cost.sim.traces import Interruptions, read_interruptions, read_prices

    cfg = load_sim_config(config)
    prices = trace or resolve(config, cfg.traces.prices)
    if prices is None:
        raise ConfigError(f"{config}: no price trace: pass --trace prices.json or set traces.prices")
    advisor = interruptions or resolve(config, cfg.traces.interruptions)
    price_trace = read_prices(prices, cfg.fleet.instance_type, cfg.fleet.zones)
    info = read_interruptions(advisor) if advisor is not None else Interruptions()
    setup = Setup.of(cfg, price_trace, info)
    results = simulate(cfg, setup)
    console = Console(width=120)
    f = cfg.fleet
    gpus = f"{f.min_nodes * f.gpus_per_node}-{f.max_nodes * f.gpus_per_node} GPUs"
    seeds = "replayed events" if info.events else f"mean of {cfg.world.seeds} seeds"
    console.print(table(results, f"{price_trace.instance_type}, {gpus}, {seeds}"))
    write(out, as_json(cfg, setup, results, trace_names(prices, advisor)), results, console)
