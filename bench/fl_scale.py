"""Cross-device scale: 1,000 / 100,000 / 1,000,000 registered clients, 100 and 1,000 trained per round.

    python bench/fl_scale.py [--scales 1000 100000 1000000] [--per-round 100 1000] [--rounds 3]

FedAvg, random selection, 5 local SGD steps (batch 16, momentum 0.9) of an MLP(64) on a synthetic
16-feature, 10-class set split IID (2–3 rows per client at most scales; 20,000 rows at least),
evaluation sampled (100 clients) every round. Each setting runs in its own process, so its peak
memory (max RSS) is its own; set-up is the run's wall time less its rounds. Beside each run, in the
same process, the bare compute of one round: the same clients' 5 steps in a plain PyTorch loop
(one model, weights copied in, a fresh torch SGD, batches already in memory) — what a hand-written
loop costs. Rounds 2..R are timed (round 1 warms up).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _common import print_table, write_result
from vatra.config import config_from_dict
from vatra.federated.client import client_seed, initial_weights
from vatra.federated.data import build_federation
from vatra.federated.evaluate import batch_fetcher
from vatra.federated.simulation import simulate
from vatra.losses import build_loss
from vatra.rundir import RunDir, read_jsonl

STEPS = 5


def config(clients: int, per_round: int, rounds: int) -> Any:
    return config_from_dict(
        {
            "run": {"seed": 0, "progress": "off", "tensorboard": False},
            "monitor": {"report": False},
            "data": {"name": "synthetic", "samples": max(20_000, int(clients * 2.5)), "n_features": 16}
            | {"informative": 8},
            "model": {"name": "mlp", "hidden": [64]},
            "train": {"batch_size": 16},
            "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
            "federated": {
                "rounds": rounds,
                "clients": clients,
                "clients_per_round": per_round,
                "local_steps": STEPS,
                "partition": {"method": "iid"},
            },
        }
    )


def bare_round(cfg: Any, selected: list[int]) -> float:
    """Seconds of the selected clients' steps in a plain PyTorch loop, batches prepared beforehand
    (the fastest of three passes)."""
    fed = build_federation(cfg)
    model, layout, init = initial_weights(cfg, fed.spec)
    loss = build_loss(cfg.train, fed.spec)
    from vatra.data import ShardSampler

    work = []
    for c in selected:
        data = fed.client_data(c)
        sampler = ShardSampler(data.train_rows, cfg.train.batch_size, seed=client_seed(0, 1, c))
        fetch = batch_fetcher(data.train)
        work.append([fetch(sampler.next_batch()) for _ in range(STEPS)])
    times = []
    for _ in range(3):  # the fastest of three: the machine is shared
        t0 = time.perf_counter()
        for batches in work:
            layout.load(model, init)
            opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum)
            for x, y in batches:
                opt.zero_grad(set_to_none=True)
                loss(model(x), y).backward()
                opt.step()
        times.append(time.perf_counter() - t0)
    return min(times)


def one(clients: int, per_round: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = config(clients, per_round, rounds)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        simulate(cfg, RunDir(Path(tmp)), progress=False)
        wall = time.perf_counter() - t0
        rows = read_jsonl(Path(tmp) / "metrics.jsonl")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    later = rows[1:] or rows
    bare = bare_round(cfg, rows[-1]["selected"])
    return {
        "clients": clients,
        "per_round": per_round,
        "setup_s": wall - sum(r["round_time_s"] for r in rows),
        "round_s": statistics.median(r["round_time_s"] for r in later),
        "fit_s": statistics.median(r["fit_time_s"] for r in later),
        "bare_s": bare,
        "peak_mb": peak_mb,
        "accuracy": rows[-1].get("global_accuracy"),
    }


def _row(r: dict[str, Any]) -> list[Any]:
    ratio = r["fit_s"] / r["bare_s"]
    times = [f"{r['setup_s']:.1f}", f"{r['round_s']:.3f}", f"{r['fit_s']:.3f}", f"{r['bare_s']:.3f}"]
    return [r["clients"], r["per_round"], *times, f"{ratio:.2f}", f"{r['peak_mb']:.0f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    ap.add_argument("--per-round", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", type=int, nargs=2, help=argparse.SUPPRESS)  # a child: clients per_round
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.rounds)))
        return
    results = []
    for n in args.scales:
        for k in args.per_round:
            if k > n:
                continue
            cmd = [sys.executable, __file__, "--one", str(n), str(k), "--rounds", str(args.rounds)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode:
                print(f"{n} clients, {k} per round: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"done {n} / {k}", file=sys.stderr, flush=True)
    print_table(
        ["registered", "per round", "set-up s", "round s", "fit s", "bare loop s", "fit / bare", "peak MB"],
        [_row(r) for r in results],
    )
    write_result("fl_scale", {"steps": STEPS, "results": results, "note": "machine shared, 2 cores"})


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
