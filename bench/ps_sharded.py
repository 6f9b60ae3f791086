"""The sharded parameter server against sync DDP and DiLoCo on the namespace cluster, one rank 3× slower.

The setting of bench/asyncdp_modes.py (synthetic example, MLP 512-512, AdamW, 64 samples a worker a
step, 100 Mbit/s links, ``chaos.speed_factors = [1,1,1,3]``, evaluation every 32 steps): sync DDP
and DiLoCo (H = 32) on 4 hosts × 1 process; the asynchronous parameter server on the same 4 hosts
× 2 processes, a worker and a server shard on each host (``dist.servers = 4``, placed one per host
by the launcher), with each ``dist.ps_wire`` and staleness rule in ROWS; and, for reference, the
one-server layout (4 worker hosts and a fifth for the server) with ``--one-server``.

Time to target: rank 0's summed step time (training only) to the first evaluation at or above sync
DDP's final accuracy − 1 point, measured in the same run (DiLoCo: evaluations right after an outer
step). Throughput: samples all workers processed per second of rank 0's training time (async: the
workers' steps, the slow one's included, from each worker's metrics). Bytes: the kernel's counters
of every host's shaped link, per rank-0 step.

    .venv/bin/python bench/ps_sharded.py [--steps 300] [--local-steps 900] [--one-server] [--only "sync,..."]
    (as root: it builds the network-namespace cluster; 20 min at load average 20 on 2 cores, most
    of it the start-up of 8 processes a run)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from _comm_cluster import ROOT, train_on_cluster
from _common import write_result
from asyncdp_modes import MODEL, SLOW, _row
from vatra.launch.cluster import Cluster, ClusterSpec
from vatra.rundir import read_jsonl

ASYNC = ["dist.mode=async"]
SHARDED = [*ASYNC, "dist.servers=4"]
# (name, hosts × procs, sets, H, budget: "base" = --steps, "local" = --local-steps)
ROWS: list[tuple[str, tuple[int, int], list[str], int, str]] = [
    ("sync", (4, 1), ["dist.mode=sync"], 1, "base"),
    ("diloco H=32", (4, 1), ["dist.mode=diloco", "diloco.inner_steps=32"], 32, "local"),
    ("async 4 shards fp32 none", (4, 2), [*SHARDED, "dist.ps_wire=fp32", "async.staleness=none"], 1, "base"),
    ("async 4 shards fp16 none", (4, 2), [*SHARDED, "dist.ps_wire=fp16", "async.staleness=none"], 1, "base"),
    ("async 4 shards fp16 exp", (4, 2), [*SHARDED, "dist.ps_wire=fp16", "async.staleness=exp"], 1, "base"),
    (
        "async 4 shards topk none",
        (4, 2),
        [*SHARDED, "dist.ps_wire=topk", "comm.ratio=0.1", "async.staleness=none"],
        1,
        "base",
    ),
]
ONE_SERVER = [
    ("async 1 server fp32 none", (5, 1), [*ASYNC, "dist.ps_wire=fp32", "async.staleness=none"], 1, "base"),
    ("async 1 server fp16 none", (5, 1), [*ASYNC, "dist.ps_wire=fp16", "async.staleness=none"], 1, "base"),
]


def _samples(run: Path, res: dict[str, Any], workers: int, batch: int) -> int:
    """Samples every worker trained on: rank 0's steps × batch for the synchronous modes; for async
    each worker's own metrics (worker w ≥ 1 keeps its own folder)."""
    if not any((run / "workers").glob("worker-*")):
        return len(res["metrics"]) * batch * workers
    steps = len(res["metrics"])
    for folder in sorted((run / "workers").glob("worker-*")):
        steps += sum(1 for m in read_jsonl(folder / "metrics.jsonl") if "loss" in m)
    return steps * batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="sync DDP's and async's steps (per worker)")
    ap.add_argument("--local-steps", type=int, default=900, help="DiLoCo's steps")
    ap.add_argument("--bandwidth", default="100mbit")
    ap.add_argument("--one-server", action="store_true", help="add the one-server rows (5 hosts)")
    ap.add_argument("--only", default="", help="comma-separated row names (default: all)")
    args = ap.parse_args()
    budget = {"base": args.steps, "local": args.local_steps}
    base = [*MODEL, "train.eval_every=32", "checkpoint.enabled=false", SLOW, "monitor.enabled=false"]
    rows_in = ROWS + (ONE_SERVER if args.one_server else [])
    wanted = [r for r in rows_in if not args.only or r[0] in args.only.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vatra-bench-") as tmp:
        for layout in sorted({r[1] for r in wanted}, key=lambda x: (x != (4, 1), x)):
            spec = ClusterSpec(
                name="vbps", hosts=layout[0], bandwidth=args.bandwidth, procs_per_host=layout[1]
            )
            cluster = Cluster.up(spec)
            try:
                for name, lay, sets, h, kind in wanted:
                    if lay != layout:
                        continue
                    run = Path(tmp) / name.replace(" ", "_").replace("=", "")
                    try:
                        res = train_on_cluster(
                            cluster, run, [*base, f"train.steps={budget[kind]}", *sets], 1800
                        )
                    except RuntimeError:
                        print(run.with_name(run.name + ".log").read_text()[-3000:], flush=True)
                        raise
                    row = _row(name, layout, h, args.steps, res)
                    row["samples"] = _samples(run, res, 4, 64)
                    row["samples_per_s"] = row["samples"] / row["train_s"]
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "evals"}), flush=True)
            finally:
                Cluster.down("vbps")
    _table(rows, args)


def _table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    target = (sync["final_accuracy"] - 0.01) if sync else 0.0
    for r in rows:
        hit = next((e for e in r["evals"] if e[2] >= target), None)
        r["target"], r["time_to_target_s"] = target, hit[1] if hit else None
        r["steps_to_target"] = hit[0] if hit else None
    print(f"\n{args.bandwidth} links, one rank 3x slower, target accuracy {target:.4f}")
    print(
        f"{'mode':<26} {'layout':>6} {'steps':>5} {'final acc':>9} {'to target':>10} {'vs sync':>8} "
        f"{'samples/s':>9} {'vs sync':>8} {'train s':>8} {'KB/step':>8}"
    )
    for r in rows:
        tt = r["time_to_target_s"]
        speed = sync["time_to_target_s"] / tt if sync and sync["time_to_target_s"] and tt else None
        gain = r["samples_per_s"] / sync["samples_per_s"] if sync else None
        r["speedup_to_target_vs_sync"], r["throughput_vs_sync"] = speed, gain
        print(
            f"{r['mode']:<26} {r['layout']:>6} {r['steps']:>5} {r['final_accuracy']:>9.4f} "
            f"{'—' if tt is None else f'{tt:.1f} s':>10} {'—' if speed is None else f'{speed:.2f}x':>8} "
            f"{r['samples_per_s']:>9.0f} {'—' if gain is None else f'{gain:.2f}x':>8} "
            f"{r['train_s']:>8.1f} {r['link_bytes_per_step'] / 1e3:>8.0f}"
        )
    write_result("ps_sharded", {"args": vars(args), "root": str(ROOT), "rows": rows})


if __name__ == "__main__":
    main()
