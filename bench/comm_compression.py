"""Gradient compression on a shaped 4-host cluster: time to a target accuracy and bytes sent.

    python bench/comm_compression.py            (root; about 25 minutes)
    python bench/comm_compression.py --local    (no cluster: 4 local processes, same arithmetic)

4 network namespaces × 1 process, each host's link shaped to 100 Mbit/s both ways, a 5.4 M-parameter
MLP on ``synthetic``; none / fp16 / topk 1% / onebit / powersgd rank 4 run one after another on the
same cluster with the same seed. Time to target = summed step time up to the first evaluation at or
above the target (evaluation time excluded). Bytes: what vatra's hook counted (rank 0) and what the
kernel counted on each host's link (all headers included).

Every method gets the same steps, data, optimizer and LR schedule. With SGD, topk and onebit run the
recipe that makes them converge (``RECIPES``; ``--plain`` turns it off): DGC momentum correction for
both and a per-row scale for onebit.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from _comm_cluster import median, train_local, train_on_cluster
from _common import write_result
from vatra.launch.cluster import Cluster, ClusterSpec

METHODS: dict[str, list[str]] = {
    "none": ["comm.method=none"],
    "fp16": ["comm.method=fp16"],
    "topk 1%": ["comm.method=topk", "comm.ratio=0.01"],
    "onebit": ["comm.method=onebit"],
    "powersgd r4": ["comm.method=powersgd", "comm.rank=4"],
}
# What a practitioner adds to the sparse and 1-bit methods (measured one by one in docs/benchmarks.md).
# Momentum correction needs SGD with momentum, so these apply with --optim sgd only.
# No uncompressed warm-up: at 150 steps it was within the noise, at the plateau it bought nothing, and
# 20 full-price steps made topk's 200-step run send 3.4x the bytes.
RECIPES: dict[str, list[str]] = {
    "topk 1%": ["comm.momentum_correction=true"],
    "onebit": ["comm.momentum_correction=true", "comm.onebit_scale=row"],
}


def summarise(name: str, res: dict[str, Any], target: float) -> dict[str, Any]:
    metrics = res["metrics"]
    elapsed, reached = 0.0, None
    for m in metrics:
        elapsed += m["step_time_s"]
        if reached is None and m.get("val_accuracy", 0.0) >= target:
            reached = elapsed
    steps = len(metrics)
    # method none keeps DDP's built-in all-reduce, overlapped with backward: no separate sync time
    sync = [m["comm_time_s"] for m in metrics if "comm_time_s" in m]
    return {
        "method": name,
        "time_to_target_s": reached,
        "final_val_accuracy": res["summary"]["val_accuracy"],
        "s_per_step": median([m["step_time_s"] for m in metrics]),
        "sync_s_per_step": median(sync) if sync else None,
        "comm_bytes_per_step": res["summary"]["comm_bytes"] / steps,  # warm-up steps included
        "median_step_bytes": median([m["comm_bytes"] for m in metrics]),
        "link_tx_bytes_per_step": sum(res["link_tx_bytes"]) / len(res["link_tx_bytes"]) / steps,
        "steps": steps,
        "val_curve": [[m["step"], m["val_accuracy"]] for m in metrics if "val_accuracy" in m],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--bandwidth", default="100mbit")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.40, help="validation accuracy to reach")
    ap.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--optim", default="sgd", choices=["adamw", "sgd"])
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--plain", action="store_true", help="topk and onebit without RECIPES")
    ap.add_argument("--schedule", default="cosine", choices=["constant", "cosine"])
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra override, every method")
    ap.add_argument("--local", action="store_true", help="no cluster: the same runs on local processes")
    ap.add_argument("--out", default="comm_compression", help="result name under bench/results/")
    args = ap.parse_args()
    sets = [
        f"train.steps={args.steps}", f"train.eval_every={args.eval_every}", "train.batch_size=64",
        f"optim.name={args.optim}", f"optim.lr={args.lr}", "optim.momentum=0.9",
        f"optim.schedule={args.schedule}", "optim.warmup_steps=0",
        "data.sharding=random", "run.seed=0", *args.extra,
    ]  # fmt: skip
    rows = []
    cluster = (
        None
        if args.local
        else Cluster.up(ClusterSpec(name="vbcomp", hosts=args.hosts, bandwidth=args.bandwidth))
    )
    try:
        with tempfile.TemporaryDirectory(prefix="vatra-bench-") as tmp:
            for name in args.methods:
                run_dir = Path(tmp) / name.replace(" ", "_").replace("%", "pct")
                recipe = RECIPES.get(name, []) if args.optim == "sgd" and not args.plain else []
                run_sets = sets + METHODS[name] + recipe
                if cluster is None:
                    res = train_local(args.hosts, run_dir, run_sets, timeout=1800)
                else:
                    res = train_on_cluster(cluster, run_dir, run_sets, timeout=1800)
                rows.append(summarise(name, res, args.target) | {"settings": METHODS[name] + recipe})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if cluster is not None:
            Cluster.down("vbcomp")
    base = next((r for r in rows if r["method"] == "none"), None)
    where = (
        f"{args.hosts} local processes, no shaping"
        if args.local
        else f"{args.hosts} hosts × 1 process at {args.bandwidth}"
    )
    print(f"\n{where}, target val accuracy {args.target:.2f}")
    head = f"{'method':<12} {'to target s':>11} {'speed-up':>8} {'final acc':>9} {'s/step':>7} "
    print(head + f"{'sync s/step':>11} {'MB/step':>8} {'× fewer':>8} {'median MB':>9} {'link MB/step':>12}")
    for r in rows:
        ttt, bts = r["time_to_target_s"], r["comm_bytes_per_step"]
        speed = base["time_to_target_s"] / ttt if base and ttt and base["time_to_target_s"] else None
        fewer = base["comm_bytes_per_step"] / bts if base and bts else None
        r["speedup_to_target"], r["bytes_reduction"] = speed, fewer
        print(
            f"{r['method']:<12} {ttt if ttt is not None else float('nan'):>11.1f} "
            f"{speed or float('nan'):>7.2f}× {r['final_val_accuracy']:>9.3f} {r['s_per_step']:>7.2f} "
            f"{r['sync_s_per_step'] or float('nan'):>11.2f} {bts / 1e6:>8.2f} {fewer or float('nan'):>7.1f}× "
            f"{r['median_step_bytes'] / 1e6:>9.2f} {r['link_tx_bytes_per_step'] / 1e6:>12.2f}"
        )
    write_result(args.out, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
