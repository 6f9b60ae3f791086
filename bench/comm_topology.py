"""All-reduce topology on a shaped 2-host × 2-process cluster: flat (gloo) vs ring vs hierarchical.

    python bench/comm_topology.py               (root; about 3–5 minutes)

Plain gradients (comm.method = none) of a 5.4 M-parameter MLP, hosts linked at 100 Mbit/s both
ways. Sync time per step is the time rank 0 spends inside the DDP hook (its collectives); `flat`
keeps DDP's built-in all-reduce (no hook), whose sync time is derived from backward's time. Link
bytes are the kernel's counters of each host's shaped interface (what crossed hosts).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _comm_cluster import median, train_on_cluster
from _common import write_result
from vatra.launch.cluster import Cluster, ClusterSpec

TOPOLOGIES = ["flat", "ring", "hierarchical"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--procs-per-host", type=int, default=2)
    ap.add_argument("--bandwidth", default="100mbit")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    # comm.overlap=false: the compute estimate below is backward's time less the hook's, which holds
    # only when the hook runs on the autograd thread
    sets = [f"train.steps={args.steps}", "train.eval_every=0", "train.batch_size=64", "comm.method=none"]
    sets.append("comm.overlap=false")
    spec = ClusterSpec(
        name="vbtopo", hosts=args.hosts, bandwidth=args.bandwidth, procs_per_host=args.procs_per_host
    )
    rows = []
    cluster = Cluster.up(spec)
    try:
        with tempfile.TemporaryDirectory(prefix="vatra-bench-") as tmp:
            for topo in TOPOLOGIES:
                res = train_on_cluster(
                    cluster, Path(tmp) / topo, [*sets, f"comm.topology={topo}"], timeout=600
                )
                # the first step includes DDP's bucket rebuild and connection set-up: left out
                metrics = res["metrics"][1:]
                steps = len(res["metrics"])
                hooked = all("comm_time_s" in m for m in metrics)
                rows.append(
                    {
                        "topology": topo,
                        "hook": "vatra" if hooked else "ddp-builtin",
                        "sync_s_per_step": median([m["comm_time_s"] for m in metrics]) if hooked else None,
                        "fwd_bwd_s_per_step": median([m["fwd_bwd_time_s"] for m in metrics]),
                        "compute_s_per_step": median(
                            [m["fwd_bwd_time_s"] - m["comm_time_s"] for m in metrics] if hooked else []
                        ),
                        "s_per_step": median([m["step_time_s"] for m in metrics]),
                        "rank0_comm_bytes_per_step": res["summary"]["comm_bytes"] / steps,
                        "link_tx_bytes_per_host_step": sum(res["link_tx_bytes"])
                        / len(res["link_tx_bytes"])
                        / steps,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        Cluster.down("vbtopo")
    # `flat` with comm.method = none keeps DDP's built-in all-reduce, which runs inside backward: its
    # sync time is backward's time less the forward/backward compute the hooked runs measured.
    compute = median([r["compute_s_per_step"] for r in rows if r["sync_s_per_step"] is not None])
    for r in rows:
        if r["sync_s_per_step"] is None:
            r["sync_s_per_step"] = r["fwd_bwd_s_per_step"] - compute
            r["sync_derived"] = True
    flat, flat_step = rows[0]["sync_s_per_step"], rows[0]["s_per_step"]
    print(f"\n{args.hosts} hosts × {args.procs_per_host} processes at {args.bandwidth}")
    print(
        f"{'topology':<13} {'sync s/step':>11} {'vs flat':>8} {'s/step':>7} {'vs flat':>8} "
        f"{'rank-0 MB/step':>14} {'link MB/host/step':>17}"
    )
    for r in rows:
        r["sync_speedup_vs_flat"] = flat / r["sync_s_per_step"]
        r["step_speedup_vs_flat"] = flat_step / r["s_per_step"]
        mark = "*" if r.get("sync_derived") else " "
        print(
            f"{r['topology']:<13} {r['sync_s_per_step']:>10.2f}{mark} {r['sync_speedup_vs_flat']:>7.2f}× "
            f"{r['s_per_step']:>7.2f} {r['step_speedup_vs_flat']:>7.2f}× "
            f"{r['rank0_comm_bytes_per_step'] / 1e6:>14.2f} {r['link_tx_bytes_per_host_step'] / 1e6:>17.2f}"
        )
    print("* DDP's built-in all-reduce, inside backward: backward time less the hooked runs' compute")
    write_result("comm_topology", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
