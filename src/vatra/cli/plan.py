"""``vatra plan``: rank every parallel layout of a world size by estimated step time and memory."""

from __future__ import annotations

from pathlib import Path

import typer

from vatra.cli.app import app
from vatra.config import load_config

SET_HELP = "Override a config value: section.key=value (repeatable)."


@app.command("plan")
def plan_command(
    config: Path = typer.Argument(..., help="TOML config file (model.name = 'gpt')."),
    world: int = typer.Option(..., "--world", min=1, help="Ranks to lay out."),
    memory_gb: float | None = typer.Option(None, "--memory-gb", min=0.0, help="Memory per rank."),
    bandwidth_gbs: float = typer.Option(
        1.0, "--bandwidth-gbs", min=1e-6, help="Link bandwidth between ranks, GB/s (not measured)."
    ),
    latency_us: float = typer.Option(
        50.0, "--latency-us", min=0.0, help="What one collective or send costs however small, µs."
    ),
    set_: list[str] = typer.Option([], "--set", help=SET_HELP),
) -> None:
    """Measure the model's blocks on this process, estimate every dp × fsdp × tp × pp layout of
    --world ranks (the pipeline bubble, collective volumes, memory per rank), and print them
    ranked, the infeasible ones last with the reason (docs/parallel.md has the formulas)."""
    from vatra.parallel.plan import measure, plan

    cfg = load_config(config, set_)
    costs = measure(cfg)
    ranked = plan(
        costs, cfg, world, bandwidth=bandwidth_gbs * 1e9, latency=latency_us * 1e-6, memory_gb=memory_gb
    )
    print(
        f"vatra: {costs.layers} blocks, {sum(costs.block_s) * 1e3:.1f} ms forward + backward on "
        f"{costs.batch} samples; global batch {cfg.train.batch_size * world}, schedule "
        f"{cfg.parallel.schedule}, {bandwidth_gbs:g} GB/s, {latency_us:g} µs a message"
    )
    print(f"{'#':>3} {'dp':>3} {'fsdp':>4} {'tp':>3} {'pp':>3} {'m':>3} {'step_s':>9} {'comm_s':>9} "
          f"{'bubble':>6} {'mem_GB':>8}  feasible")  # fmt: skip
    for i, e in enumerate(ranked, 1):
        if e.compute_s or e.memory_gb:
            figures = f"{e.step_s:9.4f} {e.comm_s:9.4f} {e.bubble:6.1%} {e.memory_gb:8.3f}"
        else:
            figures = f"{'-':>9} {'-':>9} {'-':>6} {'-':>8}"
        verdict = f"no: {e.why}" if e.why else "yes"
        print(f"{i:>3} {e.dp:>3} {e.fsdp:>4} {e.tp:>3} {e.pp:>3} {e.microbatches:>3} {figures}  {verdict}")
