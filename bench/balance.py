"""Mixed hardware: static (even) against proportional per-rank batches, the whole `vatra train` path.

    python bench/balance.py [--reps 2] [--speed-factors 1 1 2 4] [--workloads digits wide]

Four local ranks, rank r computing ``speed_factors[r]`` times slower (``chaos.speed_factors``: after
each forward pass a sleep of (factor − 1) × its forward-and-backward time). Workloads: ``digits``
(examples/digits.toml as shipped: MLP 128-128, global batch 128, 300 steps) and ``wide`` (the same
data, an MLP 1024-1024-1024, global batch 256). Rows per workload, in one run, their order rotated
rep by rep so machine noise hits each alike:

* ``off``: plain DDP, every rank 1/4 of the global batch (the per-rank shards of ``data.sharding``);
* ``static``: the balanced sampler with the even split (what ``off`` computes, measured);
* ``proportional``: batches follow each rank's measured speed;
* ``ppo``: a PPO policy trained first in the simulated cluster (``vatra balance train-agent`` with
  ``--timesteps``, the same ranks and global batch), then deployed.

Reported: time to target (summed step time up to the first evaluation at or above the target),
total train time, final accuracy, mean utilisation over ranks (busy / wall), the compute balance
(mean busy time over the slowest rank's), both from the balancer's windows after the first, and the
last split. Step times on 2 cores with 4 processes include CPU
contention between ranks; ratios, not absolute times, are the result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS: dict[str, list[str]] = {
    "digits": [],
    "wide": ["model.hidden=[1024, 1024, 1024]", "train.batch_size=64"],
}
PER_RANK_BATCH = {"digits": 32, "wide": 64}  # per rank (train.batch_size)
TARGET = {"digits": 0.96, "wide": 0.97}


def run_once(
    workload: str, method: str, factors: list[float], out: Path, policy: Path | None
) -> dict[str, Any]:
    sets = [
        f"run.out_dir={out}",
        "run.progress=off",
        "train.eval_every=25",
        f"chaos.speed_factors={json.dumps(factors)}",
        *WORKLOADS[workload],
    ]
    if method != "off":
        sets.append(f"balance.method={method}")
    if method == "ppo":
        sets.append(f"balance.policy={policy}")
    cmd = [sys.executable, "-m", "vatra", "train", "examples/digits.toml", "--nproc", str(len(factors))]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{workload}/{method} failed:\n{done.stderr[-3000:]}")
    (run,) = out.iterdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    elapsed, to_target = 0.0, None
    for row in rows:
        elapsed += row["step_time_s"]
        if to_target is None and row.get("val_accuracy", 0.0) >= TARGET[workload]:
            to_target = elapsed
    final = summary.get("val_accuracy")
    if to_target is None and final is not None and final >= TARGET[workload]:
        to_target = elapsed
    windows = [e for e in events if e["event"] == "balance" and "changed" in e][1:]
    util = statistics.mean(e["mean_utilisation"] for e in windows) if windows else None
    balance = statistics.mean(e["compute_balance"] for e in windows) if windows else None
    sizes = windows[-1]["sizes"] if windows else None
    return {
        "time_to_target_s": to_target,
        "train_s": elapsed,
        "final_val_accuracy": final,
        "utilisation": util,
        "compute_balance": balance,
        "sizes": sizes,
        "decisions": sum(1 for e in windows if e.get("changed")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--speed-factors", type=float, nargs="+", default=[1, 1, 2, 4])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--methods", nargs="+", default=["off", "static", "proportional", "ppo"])
    ap.add_argument("--timesteps", type=int, default=10_000, help="PPO training decisions (simulated)")
    ap.add_argument("--out", default="balance")
    args = ap.parse_args()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    simulated: dict[str, dict[str, float]] = {}
    policies = Path(tempfile.mkdtemp(prefix="vatra-policies-"))
    for workload in args.workloads:
        policy = None
        if "ppo" in args.methods:
            from vatra.balance.ppo import compare, load_agent, train_agent

            ranks, total = len(args.speed_factors), PER_RANK_BATCH[workload] * len(args.speed_factors)
            t0 = time.perf_counter()
            policy = train_agent(
                policies / f"{workload}.zip", ranks=ranks, global_batch=total, timesteps=args.timesteps
            )
            simulated[workload] = {
                **compare(load_agent(policy, ranks), ranks=ranks, global_batch=total),
                "train_agent_s": time.perf_counter() - t0,
            }
            print(
                json.dumps({"workload": workload, "simulated_utilisation": simulated[workload]}), flush=True
            )
        results[workload] = {m: [] for m in args.methods}
        for rep in range(args.reps):
            shift = rep % len(args.methods)
            for method in args.methods[shift:] + args.methods[:shift]:
                with tempfile.TemporaryDirectory() as tmp:
                    r = run_once(workload, method, args.speed_factors, Path(tmp), policy)
                results[workload][method].append(r)
                print(json.dumps({"workload": workload, "method": method, "rep": rep, **r}), flush=True)
    table = []
    for workload, by_method in results.items():
        base = statistics.median(r["train_s"] for r in by_method[args.methods[0]])
        for method, runs in by_method.items():
            ttt = [r["time_to_target_s"] for r in runs if r["time_to_target_s"] is not None]
            utils = [r["utilisation"] for r in runs if r["utilisation"] is not None]
            balances = [r["compute_balance"] for r in runs if r["compute_balance"] is not None]
            train = statistics.median(r["train_s"] for r in runs)
            table.append(
                [
                    workload,
                    method,
                    f"{statistics.median(ttt):.1f}" if len(ttt) == len(runs) else "not reached",
                    f"{train:.1f}",
                    f"{base / train:.2f}×",
                    f"{statistics.median(r['final_val_accuracy'] for r in runs):.4f}",
                    f"{100 * statistics.median(utils):.0f} %" if utils else "n/a",
                    f"{100 * statistics.median(balances):.0f} %" if balances else "n/a",
                    str(runs[-1]["sizes"] or "even"),
                ]
            )
    print_table(
        [
            "workload",
            "method",
            "to target s",
            "train s",
            f"vs {args.methods[0]}",
            "final acc",
            "util",
            "balance",
            "split",
        ],
        table,
    )
    for workload, sim in simulated.items():
        print(f"{workload}: simulated compute balance " + ", ".join(f"{k} {v:.3f}" for k, v in sim.items()))
    write_result(
        args.out,
        {"speed_factors": args.speed_factors, "target": TARGET, "results": results, "simulated": simulated},
    )


if __name__ == "__main__":
    main()
