"""Simulation speed: rounds per minute and client updates per second at 20, 100 and 500 clients.

    python bench/fl_sim_speed.py [--rounds 4] [--clients 20 100 500]

FedAvg, every client every round, 5 local SGD steps of batch 16, MLP(32) on digits (IID shards;
500 clients hold ~3 samples each). The feature, a pool of 2 worker processes, runs side by side
with its baseline, every client trained in the server process (workers = 1). Round 1 includes the
workers' start-up (spawn + import torch) and is reported apart; the rates use rounds 2..R.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import print_table, write_result
from vatra.config import config_from_dict
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl


def run(clients: int, workers: int, rounds: int) -> dict[str, Any]:
    cfg = config_from_dict(
        {
            "run": {"seed": 0, "progress": "off", "tensorboard": False},
            "monitor": {"report": False},
            "data": {"name": "digits"},
            "model": {"name": "mlp", "hidden": [32]},
            "train": {"batch_size": 16},
            "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "federated": {
                "strategy": "fedavg",
                "rounds": rounds,
                "clients": clients,
                "selection": "all",
                "local_steps": 5,
                "workers": workers,
                "partition": {"method": "iid"},
            },
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        summary = simulate(cfg, RunDir(Path(tmp)), progress=False)
        wall = time.perf_counter() - t0
        rows = read_jsonl(Path(tmp) / "metrics.jsonl")
    steady = statistics.median(r["round_time_s"] for r in rows[1:])
    return {
        "clients": clients,
        "workers": workers,
        "first_round_s": rows[0]["round_time_s"],
        "round_s": steady,
        "rounds_per_min": 60.0 / steady,
        "updates_per_s": clients / steady,
        "wall_s": wall,
        "bytes_per_round": rows[-1]["bytes_up"] + rows[-1]["bytes_down"],
        "weights_sha256": summary["weights_sha256"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, nargs="+", default=[20, 100, 500])
    args = parser.parse_args()
    rows, results = [], []
    for n in args.clients:
        base, pool = run(n, 1, args.rounds), run(n, 2, args.rounds)
        assert base["weights_sha256"] == pool["weights_sha256"], "pool and in-process runs must agree"
        results += [base, pool]
        for r in (base, pool):
            rows.append(
                [n, r["workers"], r["first_round_s"], r["round_s"], r["rounds_per_min"], r["updates_per_s"]]
            )
        rows[-1].append(f"{pool['updates_per_s'] / base['updates_per_s']:.2f}x")
        rows[-2].append("1.00x")
    headers = ["clients", "workers", "round 1 s", "round s", "rounds/min", "updates/s", "speed-up"]
    print_table(headers, rows)
    write_result("fl_sim_speed", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
