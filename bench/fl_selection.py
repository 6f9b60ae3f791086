"""Adaptive (Oort-like) vs random client selection: time to a target accuracy with slow devices.

    python bench/fl_selection.py [--rounds 40] [--seeds 3] [--target 0.9]

100 clients with label skew (Dirichlet alpha 0.5), 10 selected per round, FedAvg, 10 local steps.
Device speeds are heterogeneous: client i needs ``10 steps × 0.1 s × sᵢ`` per round with
sᵢ log-normal (sigma 1; the slowest ~5% are >5x slower than the median). This time is *modelled*
(``federated.step_time_s``), not slept, so the benchmark stays short and repeatable; a synchronous
round lasts as long as its slowest selected client, and "time to target" sums those round
durations until the global accuracy first reaches the target. Both selectors run on the same
seeds side by side.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _common import print_table, write_result
from vatra.config import config_from_dict
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl


def run(selection: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg = config_from_dict(
        {
            "run": {"seed": seed, "progress": "off", "tensorboard": False},
            "monitor": {"report": False},
            "data": {"name": "digits"},
            "model": {"name": "mlp", "hidden": [64]},
            "train": {"batch_size": 16},
            "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "federated": {
                "strategy": "fedavg",
                "rounds": args.rounds,
                "clients": 100,
                "clients_per_round": 10,
                "selection": selection,
                "local_steps": 10,
                "workers": 1,
                "step_time_s": 0.1,
                "speed_sigma": 1.0,
                "partition": {"method": "dirichlet", "alpha": 0.5},
            },
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        simulate(cfg, RunDir(Path(tmp)), progress=False)
        rows = read_jsonl(Path(tmp) / "metrics.jsonl")
    elapsed, reached = 0.0, None
    for r in rows:
        elapsed += r["client_time_s"]
        if r["global_accuracy"] >= args.target:
            reached = (r["round"], elapsed)
            break
    return {
        "rounds_to_target": reached[0] if reached else None,
        "time_to_target_s": reached[1] if reached else None,
        "mean_round_s": statistics.mean(r["client_time_s"] for r in rows),
        "final_accuracy": rows[-1]["global_accuracy"],
        "distinct_clients": len({c for r in rows for c in r["selected"]}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.9)
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {"random": [], "adaptive": []}
    rows = []
    for seed in range(args.seeds):
        for selection in results:
            r = run(selection, seed, args)
            results[selection].append(r)
            t = r["time_to_target_s"]
            rows.append(
                [seed, selection, r["rounds_to_target"] or "not reached", t if t is not None else "-",
                 r["mean_round_s"], r["final_accuracy"], r["distinct_clients"]]
            )  # fmt: skip
    print_table(
        ["seed", "selection", "rounds→target", "time→target s", "mean round s", "final acc", "clients used"],
        rows,
    )
    summary = {}
    for selection, runs in results.items():
        times = [r["time_to_target_s"] for r in runs]
        summary[selection] = {
            "median_time_to_target_s": statistics.median(times) if None not in times else None,
            "median_rounds_to_target": statistics.median(r["rounds_to_target"] or args.rounds for r in runs),
            "reached": sum(t is not None for t in times),
            "mean_final_accuracy": statistics.mean(r["final_accuracy"] for r in runs),
        }
    a, b = summary["adaptive"]["median_time_to_target_s"], summary["random"]["median_time_to_target_s"]
    ratio = a / b if a and b else None
    print(f"summary: {summary}\nadaptive / random time to target: {ratio}")
    write_result(
        "fl_selection", {"args": vars(args), "runs": results, "summary": summary, "time_ratio": ratio}
    )


if __name__ == "__main__":
    main()
