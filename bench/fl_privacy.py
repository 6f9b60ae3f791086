"""Client-level DP-FedAvg on the digits federated example: accuracy vs ε (δ = 1e-5).

    python bench/fl_privacy.py [--epsilons 1 3 8 inf] [--rounds 30] [--clip 1.0] [--repeats 3]

The run is ``examples/fl_digits.toml`` (FedAvg, Dirichlet α = 0.3, MLP(64)) with
``federated.privacy.mode = "client"``; for each ε the noise multiplier z is the smallest that
keeps the RDP accountant at or below ε after all rounds (sampling rate = clients per round /
clients), found by bisection. ε = inf is the same clipped FedAvg without noise; "plain" is the
example unchanged. The same seed is used everywhere, so only the noise differs; the noise comes
from the OS entropy pool, so each DP setting is run ``--repeats`` times (mean, min–max).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Any

from _common import print_table, write_result
from vatra.config import load_config
from vatra.federated.privacy import Accountant
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fl_digits.toml"


def noise_for(epsilon: float, rate: float, rounds: int, delta: float) -> float:
    lo, hi = 0.1, 200.0
    with warnings.catch_warnings():  # probes at tiny z: "optimal order is the largest alpha"
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(50):
            mid = (lo + hi) / 2
            acc = Accountant(delta)
            acc.step(mid, rate, rounds)
            lo, hi = (mid, hi) if acc.epsilon() > epsilon else (lo, mid)
    return hi


def run(overrides: list[str], folder: Path) -> dict[str, Any]:
    cfg = load_config(EXAMPLE, ["run.progress=off", "run.tensorboard=false", *overrides])
    summary = simulate(cfg, RunDir(folder), progress=False)
    rows = read_jsonl(folder / "metrics.jsonl")
    return {**summary, "last_epsilon": rows[-1].get("epsilon")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0, math.inf])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    base = [
        f"federated.rounds={args.rounds}",
        f"federated.clients={args.clients}",
        f"federated.clients_per_round={args.per_round}",
    ]
    rate = args.per_round / args.clients
    rows, table = [], []
    with tempfile.TemporaryDirectory() as tmp:
        plain = run(base, Path(tmp) / "plain")
        rows.append({"epsilon": None, "noise_multiplier": None, "global_accuracy": plain["global_accuracy"]})
        table.append(
            ["plain FedAvg", "-", "-", plain["global_accuracy"], "-", plain["worst_client_accuracy"]]
        )
        for eps in args.epsilons:
            z = 0.0 if math.isinf(eps) else noise_for(eps, rate, args.rounds, args.delta)
            dp = [
                "federated.privacy.mode=client",
                f"federated.privacy.clip_norm={args.clip}",
                f"federated.privacy.noise_multiplier={z}",
                f"federated.privacy.delta={args.delta}",
            ]
            repeats = args.repeats if z > 0 else 1  # no noise: the run is deterministic
            runs = [run(base + dp, Path(tmp) / f"eps{eps}-{i}") for i in range(repeats)]
            accs = [s["global_accuracy"] for s in runs]
            worst = statistics.mean(s["worst_client_accuracy"] for s in runs)
            reached = runs[0]["last_epsilon"]
            rows.append(
                {
                    "epsilon": reached,
                    "target": eps,
                    "noise_multiplier": z,
                    "global_accuracy": accs,
                    "worst_client_accuracy_mean": worst,
                }
            )
            spread = f"{min(accs):.3f}–{max(accs):.3f}"
            table.append([f"ε ≤ {eps:g}", z, reached, statistics.mean(accs), spread, worst])
            print(f"ε ≤ {eps:g}: z {z:.3f}, accuracy {statistics.mean(accs):.4f} ({spread})", flush=True)
    print(
        f"\n{args.clients} clients, {args.per_round} per round, {args.rounds} rounds, clip {args.clip}, "
        f"δ = {args.delta:g}; noise at the server"
    )
    print_table(
        ["setting", "noise multiplier z", "ε reached", "global acc (mean)", "min–max", "worst client acc"],
        table,
    )
    write_result("fl_privacy", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
