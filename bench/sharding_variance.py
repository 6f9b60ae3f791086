"""Gradient variance across ranks and steps to a target accuracy: random vs stratified sharding.

    python bench/sharding_variance.py [--world 4] [--seeds 5] [--target 0.93]

Real DDP on gloo (4 processes) with vatra's Trainer on `digits`. A communication hook wraps DDP's
all-reduce to read each rank's *local* gradient before averaging, so the across-rank variance
E_r‖g_r − ḡ‖² = mean_r ‖g_r‖² − ‖ḡ‖² is measured on the real training path at every step.
`dirichlet` (alpha 0.3, non-IID) is included as the contrast where sharding does matter.
The claim tested (from the seed report): stratified shards cut gradient variance by ~67% and
converge ~35% faster than random shards.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
import torch.distributed as dist

from _common import print_table, run_ranks, write_result
from vatra.config import config_from_dict
from vatra.engine import DistContext, Plugin, Trainer

STRATEGIES = ["random", "stratified", "dirichlet"]


class VarianceProbe(Plugin):
    """Measures the across-rank variance of local gradients through a DDP comm hook."""

    def __init__(self) -> None:
        self.local_sq = torch.zeros((), dtype=torch.float64)
        self.mean_sq = torch.zeros((), dtype=torch.float64)
        self.variances: list[float] = []
        self.evals: list[tuple[int, float]] = []  # (step, validation accuracy)

    def on_fit_start(self, trainer: Trainer) -> None:
        world = trainer.dist.world_size

        # No annotations: DDP inspects them, and postponed (string) annotations fail its check.
        def hook(_state, bucket):  # type: ignore[no-untyped-def]
            buf = bucket.buffer()
            self.local_sq += buf.double().pow(2).sum()
            fut = dist.all_reduce(buf.div_(world), async_op=True).get_future()

            def averaged(f: torch.futures.Future) -> torch.Tensor:
                avg = f.value()[0]
                self.mean_sq += avg.double().pow(2).sum()
                return avg

            return fut.then(averaged)

        trainer.module.register_comm_hook(None, hook)

    def after_backward(self, trainer: Trainer) -> None:
        local = self.local_sq.clone()
        dist.all_reduce(local)  # Σ_r ‖g_r‖²
        world = trainer.dist.world_size
        self.variances.append(float(local / world - self.mean_sq))
        self.local_sq.zero_()
        self.mean_sq.zero_()

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.evals.append((trainer.state.step, metrics["val_accuracy"]))


def worker(ctx: DistContext, strategy: str, seed: int, steps: int, target: float) -> dict:
    cfg = config_from_dict(
        {
            "run": {"seed": seed, "progress": "off", "tensorboard": False},
            "data": {"name": "digits", "sharding": strategy, "alpha": 0.3},
            "model": {"name": "mlp", "hidden": [128, 128]},
            "train": {"steps": steps, "batch_size": 16, "eval_every": 5},
            "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        }
    )
    probe = VarianceProbe()
    Trainer.from_config(cfg, dist=ctx, plugins=[probe]).fit()
    hit = next((step for step, acc in probe.evals if acc >= target), None)
    return {
        "grad_var": statistics.mean(probe.variances),
        "steps_to_target": hit,
        "final_acc": probe.evals[-1][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--target", type=float, default=0.93)
    args = parser.parse_args()
    runs: list[dict] = []
    for seed in range(args.seeds):
        for strategy in STRATEGIES:
            r = run_ranks(worker, args.world, strategy, seed, args.steps, args.target)
            runs.append({"strategy": strategy, "seed": seed, **r})
            hit = r["steps_to_target"]
            print(f"seed {seed} {strategy:10s} grad var {r['grad_var']:.4g} steps to {args.target}: {hit}")
    rows, summary = [], {}
    for strategy in STRATEGIES:
        mine = [r for r in runs if r["strategy"] == strategy]
        hits = [r["steps_to_target"] for r in mine if r["steps_to_target"] is not None]
        summary[strategy] = {
            "grad_var_median": statistics.median(r["grad_var"] for r in mine),
            "steps_to_target_median": statistics.median(hits) if len(hits) == len(mine) else None,
            "reached": f"{len(hits)}/{len(mine)}",
            "final_acc_median": statistics.median(r["final_acc"] for r in mine),
        }
    base = summary["random"]
    for strategy in STRATEGIES:
        s = summary[strategy]
        var_cut = 1 - s["grad_var_median"] / base["grad_var_median"]
        speed = (
            1 - s["steps_to_target_median"] / base["steps_to_target_median"]
            if s["steps_to_target_median"] and base["steps_to_target_median"]
            else None
        )
        s["variance_cut_vs_random"], s["fewer_steps_vs_random"] = var_cut, speed
        rows.append(
            [strategy, s["grad_var_median"], f"{var_cut:+.1%}", s["steps_to_target_median"], s["reached"],
             "n/a" if speed is None else f"{speed:+.1%}", s["final_acc_median"]]
        )  # fmt: skip
    print_table(
        ["sharding", "grad var (median)", "var cut vs random", f"steps to {args.target}", "reached",
         "fewer steps vs random", "final acc"],
        rows,
    )  # fmt: skip
    write_result("sharding_variance", {"args": vars(args), "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
