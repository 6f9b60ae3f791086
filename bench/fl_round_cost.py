"""What a simulated round costs beyond its compute, and whether a process pool pays.

    python bench/fl_round_cost.py [--rounds 12] [--reps 3]

Config: examples/fl_digits.toml with every one of its 20 clients in every round (10 local steps of
batch 16, MLP(64) on digits, Dirichlet 0.3, each client holding out 20 % of its rows).

- **Round cost vs compute**: the median ``round_time_s`` of rounds 2..R (selection, encoding,
  training, decoding, aggregation, the server's and every client's evaluation, the checkpoint is
  after it) against the *compute* of the same round measured in the same process right after:
  a plain PyTorch loop that, for each client, loads the global weights, builds a fresh SGD,
  runs the same 10 steps on batches of its rows, flattens the weights, then scores the model on
  each client's held-out rows and on the server's validation split. Target: ≤ 3×.
- **workers**: the whole command ``vatra federate examples/fl_digits.toml`` (30 rounds) with the
  default ``federated.workers`` against ``workers = 1`` and ``workers = 2``, wall time of the
  process from start to exit. Target: the default is never slower than one process.
"""

from __future__ import annotations

import argparse
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
from vatra.config import load_config
from vatra.engine import seed_everything
from vatra.engine.optim import build_optimizer
from vatra.federated.client import initial_weights
from vatra.federated.data import build_federation
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fl_digits.toml"


def _cfg(rounds: int, workers: int = 1) -> Any:
    return load_config(
        EXAMPLE,
        [
            f"federated.rounds={rounds}",
            "federated.clients_per_round=0",
            f"federated.workers={workers}",
            "monitor.report=false",
            "run.progress=off",
        ],
    )


def plain_round(cfg: Any, fed: Any, weights: np.ndarray) -> float:
    """Seconds of the round's bare compute: train every client, then every evaluation."""
    model, layout, _ = initial_weights(cfg, fed.spec)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps, batch = cfg.federated.local_steps, cfg.train.batch_size
    t0 = time.perf_counter()
    for c in range(fed.num_clients):
        data = fed.client_data(c)
        layout.load(model, weights)
        opt = build_optimizer(list(model.parameters()), cfg.optim)
        rng = np.random.default_rng(c)
        for _ in range(steps):
            x, y = data.train.get_batch(rng.choice(data.train_rows, batch))
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
        layout.flatten(model)
    with torch.no_grad():
        layout.load(model, weights)
        for c in range(fed.num_clients):
            data = fed.client_data(c)
            if data.num_val:
                x, y = data.val.get_batch(data.val_rows)
                (model(x).argmax(1) == y).float().mean()
        x, y = fed.server_val.get_batch(np.arange(len(fed.server_val)))
        (model(x).argmax(1) == y).float().mean()
    return time.perf_counter() - t0


def round_cost(rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = _cfg(rounds)
    with tempfile.TemporaryDirectory() as tmp:
        simulate(cfg, RunDir(Path(tmp)), progress=False)
        rows = read_jsonl(Path(tmp) / "metrics.jsonl")
    fed = build_federation(cfg)
    seed_everything(0)
    weights = initial_weights(cfg, fed.spec)[2]
    compute = [plain_round(cfg, fed, weights) for _ in range(max(3, rounds // 2))]
    vatra_round = statistics.median(r["round_time_s"] for r in rows[1:])
    plain = statistics.median(compute)
    return {"round_s": vatra_round, "compute_s": plain, "ratio": vatra_round / plain}


def whole_command(workers: int | None) -> float:
    args = [sys.executable, "-m", "vatra", "federate", str(EXAMPLE), "--set", "run.progress=off"]
    args += ["--set", "monitor.report=false"]
    if workers is not None:
        args += ["--set", f"federated.workers={workers}"]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run(
            [*args, "--run-dir", str(Path(tmp) / "run")], check=True, capture_output=True, cwd=ROOT
        )
        return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    costs = [round_cost(args.rounds) for _ in range(args.reps)]
    walls: dict[str, list[float]] = {"default": [], "1": [], "2": []}
    keys = list(walls)
    for rep in range(args.reps):  # interleaved, in a rotating order: machine noise hits each alike
        for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:
            walls[key].append(whole_command(None if key == "default" else int(key)))
    ratio = statistics.median(c["ratio"] for c in costs)
    rows = [
        ["round / compute", f"{statistics.median(c['round_s'] for c in costs) * 1e3:.0f} ms",
         f"{statistics.median(c['compute_s'] for c in costs) * 1e3:.0f} ms", f"{ratio:.2f}x"],
    ]  # fmt: skip
    one = statistics.median(walls["1"])
    for key, values in walls.items():
        med = statistics.median(values)
        rows.append([f"whole command, workers = {key}", f"{med:.1f} s", f"{one:.1f} s", f"{med / one:.2f}x"])
    print_table(["measure", "vatra", "baseline", "ratio"], rows)
    write_result("fl_round_cost", {"args": vars(args), "round_cost": costs, "whole_command_s": walls})


if __name__ == "__main__":
    main()
