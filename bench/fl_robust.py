"""Robust aggregation under model poisoning on the digits federated example: accuracy after 30 rounds.

    python bench/fl_robust.py [--rounds 30] [--poisoned 0 1 4] [--scale -100] [--seeds 2]

The run is ``examples/fl_digits.toml`` (20 clients, Dirichlet α = 0.3, MLP(64), 10 local SGD
steps) with every client in every round (``clients_per_round = 20``), so a round holds exactly
the poisoned share, and ``workers = 1`` (the attack hook lives in this script's module, which
worker processes could not import). Clients 0 … k−1 are attackers: they train honestly, then
their upload hook (``UploadHook.encode``, which runs on the client, as an attacker's modified
client would) multiplies the update by ``--scale`` (−100: sign-flipped ×100) before it is sent.
The server knows nothing of it. Strategies: fedavg, median, trimmed_mean (β = 0.2), krum (f = 0:
the most Krum tolerates, ⌊(20 − 3)/2⌋ = 8), multi-Krum (the same f, m = n − f = 12), and FedAvg
after screening (``robust.screen``: updates clipped to L2 norm 2.5; honest updates measured
0.7–2.3 in the first 10 rounds). The accuracy is the server model's on the digits validation
split after the last round, the mean over ``--seeds`` seeds (the same seeds in every cell: cells
differ only by strategy and attack).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from _common import print_table, write_result
from vatra.config import load_config
from vatra.config._robust import RobustConfig
from vatra.federated import FitIns, FitRes, UploadHook
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fl_digits.toml"
VARIANTS: dict[str, list[str]] = {
    "fedavg": ["federated.strategy=fedavg"],
    "median": ["federated.strategy=median"],
    "trimmed_mean": ["federated.strategy=trimmed_mean"],
    "krum": ["federated.strategy=krum"],
    "multi-krum (m=12)": ["federated.strategy=krum", "federated.robust.krum_m=12"],
    "fedavg + clip 2.5": ["federated.strategy=fedavg", "federated.robust.max_update_norm=2.5"],
}


class PoisonedUpload(UploadHook):
    """The attacker's client: its honest update times ``scale`` for the client ids in ``attackers``.

    The server screens every round itself (``federated.robust``: a no-op unless
    ``max_update_norm`` or ``max_num_samples`` is set), as it would against a real attacker.
    """

    name = "poisoned"

    def __init__(self, attackers: set[int], scale: float, robust: RobustConfig) -> None:
        self.attackers = attackers
        self.scale = scale
        self.robust = robust

    def encode(self, res: FitRes, ins: FitIns) -> FitRes:
        if res.client_id in self.attackers:
            res.update = (res.update.astype(np.float64) * self.scale).astype(np.float32)
        return res


def run(variant: str, poisoned: int, seed: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    overrides = [
        f"run.seed={seed}",
        "run.progress=off",
        "run.tensorboard=false",
        "monitor.report=false",
        *VARIANTS[variant],
        f"federated.rounds={args.rounds}",
        "federated.clients=20",
        "federated.clients_per_round=20",
        "federated.workers=1",
    ]
    cfg = load_config(EXAMPLE, overrides)
    hook = PoisonedUpload(set(range(poisoned)), args.scale, cfg.federated.robust)
    summary = simulate(cfg, RunDir(folder), hook=hook, progress=False)
    rows = read_jsonl(folder / "metrics.jsonl")
    return {
        "seed": seed,
        "global_accuracy": summary["global_accuracy"],
        "best_global_accuracy": summary["best_global_accuracy"],
        "accuracy_per_round": [r.get("global_accuracy") for r in rows],
        "wall_s": summary["wall_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--poisoned", type=int, nargs="+", default=[0, 1, 4])
    ap.add_argument("--scale", type=float, default=-100.0)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            for k in args.poisoned:
                key = f"{variant}/{k}"
                runs = [
                    run(variant, k, seed, args, Path(tmp) / f"{len(results)}-{seed}")
                    for seed in range(args.seeds)
                ]
                results[key] = {
                    "global_accuracy": statistics.mean(r["global_accuracy"] for r in runs),
                    "wall_s": statistics.mean(r["wall_s"] for r in runs),
                    "per_seed": runs,
                }
                print(f"{key}: accuracy {results[key]['global_accuracy']:.4f}", flush=True)
    headers = ["strategy", *(f"{k} of 20 poisoned" for k in args.poisoned), "wall s (clean)"]
    table = [
        [
            v,
            *(results[f"{v}/{k}"]["global_accuracy"] for k in args.poisoned),
            results[f"{v}/{args.poisoned[0]}"]["wall_s"],
        ]
        for v in args.variants
    ]
    print_table(headers, table)
    write_result("fl_robust", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
