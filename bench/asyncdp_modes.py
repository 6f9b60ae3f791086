"""Every dist.mode on the namespace cluster: time to a target accuracy, final accuracy, bytes across hosts.

The synthetic example with one model and the same data for every mode, hosts linked at 100 Mbit/s,
one rank 3× slower (chaos.speed_factors): sync DDP, local SGD (H = 8, 32), DiLoCo (H = 32, 128;
streaming fragments with fp16 outer gradients; per-rank inner steps), hybrid (2 hosts × 2 ranks:
DDP inside a host, DiLoCo across) and the asynchronous parameter server (4 worker hosts and a server
host) with each staleness rule, and batched against one-message-per-tensor messages.

Time to target: rank 0's summed step time (training time, evaluation excluded) up to the first
evaluation at or above the target, counting only evaluations where the mode has just synchronised
(DiLoCo and local SGD: steps that are multiples of H). The target is sync DDP's final accuracy less
one point, measured in the same run. Sync and async train --steps steps; the modes whose steps are
cheap (local SGD, DiLoCo, hybrid) --local-steps, and their accuracy at --steps is reported too.
Bytes: the kernel's counters of every host's shaped link, per step.

    .venv/bin/python bench/asyncdp_modes.py [--steps 400] [--local-steps 1200] [--only "sync,diloco H=32"]
    (as root: it builds the network-namespace cluster)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from _comm_cluster import ROOT, train_on_cluster
from _common import write_result
from vatra.launch.cluster import Cluster, ClusterSpec

MODEL = ["model.name=mlp", "model.hidden=[512,512]"]
SLOW = "chaos.speed_factors=[1,1,1,3]"
# (name, hosts × procs, sets, H: the steps at which the mode is synchronised, step budget: "base" =
# --steps, "local" = --local-steps (the modes whose steps are cheap), "probe" = --probe-steps (a
# message-layout comparison: bytes and step time only))
ROWS: list[tuple[str, tuple[int, int], list[str], int, str]] = [
    ("sync", (4, 1), ["dist.mode=sync"], 1, "base"),
    ("local_sgd H=8", (4, 1), ["dist.mode=local_sgd", "local_sgd.every=8"], 8, "local"),
    ("local_sgd H=32", (4, 1), ["dist.mode=local_sgd", "local_sgd.every=32"], 32, "local"),
    ("diloco H=32", (4, 1), ["dist.mode=diloco", "diloco.inner_steps=32"], 32, "local"),
    ("diloco H=128", (4, 1), ["dist.mode=diloco", "diloco.inner_steps=128"], 128, "local"),
    (
        "diloco H=32 4 fragments fp16",
        (4, 1),
        ["dist.mode=diloco", "diloco.inner_steps=32", "diloco.fragments=4", "comm.method=fp16"],
        32,
        "local",
    ),
    (
        "diloco H=32 fp16 adaptive",
        (4, 1),
        ["dist.mode=diloco", "diloco.inner_steps=32", "comm.method=fp16", "diloco.adaptive_steps=true"],
        32,
        "local",
    ),
    (
        "diloco H=8 fp16 batched",
        (4, 1),
        ["dist.mode=diloco", "diloco.inner_steps=8", "comm.method=fp16"],
        8,
        "probe",
    ),
    (
        "diloco H=8 fp16 per-tensor",
        (4, 1),
        ["dist.mode=diloco", "diloco.inner_steps=8", "comm.method=fp16", "comm.bucket_mb=0.000001"],
        8,
        "probe",
    ),
    (
        "hybrid 2x2 H=32",
        (2, 2),
        ["dist.mode=hybrid", "hybrid.group_size=2", "diloco.inner_steps=32"],
        32,
        "local",
    ),
    ("async none", (5, 1), ["dist.mode=async", "async.staleness=none", "comm.method=fp16"], 1, "base"),
    ("async inverse", (5, 1), ["dist.mode=async", "async.staleness=inverse", "comm.method=fp16"], 1, "base"),
    ("async exp", (5, 1), ["dist.mode=async", "async.staleness=exp", "comm.method=fp16"], 1, "base"),
    ("async inverse batched", (5, 1), ["dist.mode=async", "comm.method=fp16"], 1, "probe"),
    (
        "async inverse per-tensor",
        (5, 1),
        ["dist.mode=async", "comm.method=fp16", "comm.bucket_mb=0.000001"],
        1,
        "probe",
    ),
]


def _row(name: str, layout: tuple[int, int], h: int, base_steps: int, res: dict[str, Any]) -> dict[str, Any]:
    metrics = res["metrics"]
    evals, elapsed = [], 0.0
    for m in metrics:
        elapsed += m["step_time_s"]
        if "val_accuracy" in m and m["step"] % h == 0:
            evals.append((m["step"], elapsed, m["val_accuracy"]))
    summary = res["summary"]
    at_base = [e for e in evals if e[0] <= base_steps]
    return {
        "mode": name,
        "steps": len(metrics),
        "accuracy_at_base_steps": at_base[-1][2] if at_base else None,
        "layout": f"{layout[0]}x{layout[1]}",
        "evals": evals,
        "final_accuracy": summary.get("val_accuracy"),
        "train_s": elapsed,
        "wall_s": res["wall_s"],
        "link_tx_bytes": sum(res["link_tx_bytes"]),
        "s_per_step": elapsed / max(1, len(metrics)),
        "link_bytes_per_step": sum(res["link_tx_bytes"]) / max(1, len(metrics)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="sync DDP's and async's steps")
    ap.add_argument("--local-steps", type=int, default=1200, help="local SGD's, DiLoCo's and hybrid's steps")
    ap.add_argument("--probe-steps", type=int, default=96, help="the message-layout comparisons' steps")
    ap.add_argument("--bandwidth", default="100mbit")
    ap.add_argument("--only", default="", help="comma-separated mode names (default: all)")
    args = ap.parse_args()
    budget = {"base": args.steps, "local": args.local_steps, "probe": args.probe_steps}
    base = [*MODEL, "train.eval_every=32", "checkpoint.enabled=false", SLOW]
    base += ["monitor.enabled=false"]  # the same for every mode; run.progress and tensorboard are off
    wanted = [r for r in ROWS if not args.only or r[0] in args.only.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vatra-bench-") as tmp:
        for layout in sorted({r[1] for r in wanted}, key=lambda x: (x != (4, 1), x)):
            spec = ClusterSpec(
                name="vbmode", hosts=layout[0], bandwidth=args.bandwidth, procs_per_host=layout[1]
            )
            cluster = Cluster.up(spec)
            try:
                for name, lay, sets, h, kind in wanted:
                    if lay != layout:
                        continue
                    run = Path(tmp) / name.replace(" ", "_").replace("=", "")
                    steps = [f"train.steps={budget[kind]}"]
                    if kind == "probe":
                        steps.append("train.eval_every=0")
                    res = train_on_cluster(cluster, run, [*base, *steps, *sets], timeout=1800)
                    rows.append(_row(name, layout, h, args.steps, res))
                    rows[-1]["budget"] = kind
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "evals"}), flush=True)
            finally:
                Cluster.down("vbmode")
    sync = next((r for r in rows if r["mode"] == "sync"), None)
    target = (sync["final_accuracy"] - 0.01) if sync else 0.0
    for r in rows:
        hit = next((e for e in r["evals"] if e[2] >= target), None)
        r["target"] = target
        r["time_to_target_s"] = hit[1] if hit else None
        r["steps_to_target"] = hit[0] if hit else None
    print(f"\n{args.bandwidth} links, one rank 3x slower, target accuracy {target:.4f}")
    print(
        f"{'mode':<30} {'layout':>6} {'steps':>5} {'final acc':>9} {f'acc@{args.steps}':>8} "
        f"{'to target':>10} {'vs sync':>8} {'train s':>8} {'link MB':>9} {'bytes/step vs sync':>18}"
    )
    for r in rows:
        if r["budget"] == "probe":
            continue
        tt = r["time_to_target_s"]
        speed = sync["time_to_target_s"] / tt if sync and sync["time_to_target_s"] and tt else None
        per_step = r["link_bytes_per_step"]
        fewer = sync["link_bytes_per_step"] / per_step if sync and per_step else None
        r["speedup_to_target_vs_sync"], r["fewer_bytes_vs_sync"] = speed, fewer
        acc = r["accuracy_at_base_steps"]
        print(
            f"{r['mode']:<30} {r['layout']:>6} {r['steps']:>5} {r['final_accuracy']:>9.4f} "
            f"{'—' if acc is None else f'{acc:.4f}':>8} "
            f"{'—' if tt is None else f'{tt:.1f} s':>10} {'—' if speed is None else f'{speed:.2f}x':>8} "
            f"{r['train_s']:>8.1f} {r['link_tx_bytes'] / 1e6:>9.1f} "
            f"{'—' if fewer is None else f'{fewer:.1f}x':>18}"
        )
    print(f"\nmessages: fused into comm.bucket_mb buckets vs one per tensor ({args.probe_steps} steps)")
    print(f"{'mode':<30} {'s/step':>8} {'link KB/step':>13}")
    for r in rows:
        if r["budget"] == "probe":
            print(f"{r['mode']:<30} {r['s_per_step']:>8.4f} {r['link_bytes_per_step'] / 1e3:>13.1f}")
    write_result("asyncdp_modes", {"args": vars(args), "root": str(ROOT), "rows": rows})


if __name__ == "__main__":
    main()
