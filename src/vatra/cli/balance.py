"""``vatra balance train-agent``: train the learned (PPO) balancer in the simulated cluster."""

from __future__ import annotations

from pathlib import Path

import typer

from vatra._extras import require
from vatra.cli.app import app, fail

balance_app = typer.Typer(
    rich_markup_mode=None,
    help="Per-rank batches on mixed hardware: the learned balancer.",
    no_args_is_help=True,
)
app.add_typer(balance_app, name="balance")


@balance_app.command("train-agent")
def train_agent(
    ranks: int = typer.Option(4, "--ranks", min=2, help="Ranks of the runs the policy will balance."),
    global_batch: int = typer.Option(128, "--global-batch", min=2, help="Samples per step over all ranks."),
    timesteps: int = typer.Option(10_000, "--timesteps", min=100, help="Simulated decisions to train on."),
    seed: int = typer.Option(0, "--seed", help="Seeds PPO and the simulated clusters."),
    episodes: int = typer.Option(50, "--episodes", min=1, help="Held-out simulated clusters to score it on."),
    out: Path = typer.Option(Path("balance_policy.zip"), "--out", help="Where the policy is saved."),
) -> None:
    """Train a PPO policy on simulated mixed clusters, save it, and score it beside static and
    proportional on held-out clusters (compute balance: mean busy time over the slowest rank's).
    Use it with balance.method = "ppo" and balance.policy = FILE."""
    require("stable_baselines3", "balance", "vatra balance train-agent")
    from vatra.balance.ppo import compare
    from vatra.balance.ppo import train_agent as train

    if global_batch < ranks:
        fail(f"--global-batch {global_batch} cannot give each of {ranks} ranks a sample; raise it")
    saved = train(out, ranks=ranks, global_batch=global_batch, timesteps=timesteps, seed=seed)
    from vatra.balance.ppo import load_agent

    scores = compare(load_agent(saved, ranks), ranks=ranks, global_batch=global_batch, episodes=episodes)
    for name, score in scores.items():
        print(f"{name:>12}: compute balance {100 * score:.1f} % over {episodes} simulated clusters")
    print(f'vatra: policy saved to {saved} (balance.method = "ppo", balance.policy = "{saved}")')
