"""All-reduce topology on a shaped 2-host × 2-process cluster: flat (gloo) vs ring vs hierarchical.

    python bench/comm_topology.py               (root; about 3–5 minutes)

Plain gradients (comm.method = none) of a 5.4 M-parameter MLP, hosts linked at 100 Mbit/s both
ways. Sync time per step is the time rank 0 spends inside the DDP hook (its collectives); link
bytes are the kernel's counters of each host's shaped interface (what crossed hosts).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _comm_cluster import ROOT, median, train_on_cluster
from vatra.launch.cluster import Cluster, ClusterSpec

TOPOLOGIES = ["flat", "ring", "hierarchical"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--procs-per-host", type=int, default=2)
    ap.add_argument("--bandwidth", default="100mbit")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    sets = [f"train.steps={args.steps}", "train.eval_every=0", "train.batch_size=64", "comm.method=none"]
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
                rows.append(
                    {
                        "topology": topo,
                        "sync_s_per_step": median([m["comm_time_s"] for m in metrics]),
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
    flat = rows[0]["sync_s_per_step"]
    print(f"\n{args.hosts} hosts × {args.procs_per_host} processes at {args.bandwidth}")
    print(
        f"{'topology':<13} {'sync s/step':>11} {'vs flat':>8} {'s/step':>7} "
        f"{'rank-0 MB/step':>14} {'link MB/host/step':>17}"
    )
    for r in rows:
        r["sync_speedup_vs_flat"] = flat / r["sync_s_per_step"]
        print(
            f"{r['topology']:<13} {r['sync_s_per_step']:>11.2f} {r['sync_speedup_vs_flat']:>7.2f}× "
            f"{r['s_per_step']:>7.2f} {r['rank0_comm_bytes_per_step'] / 1e6:>14.2f} "
            f"{r['link_tx_bytes_per_host_step'] / 1e6:>17.2f}"
        )
    out = ROOT / "bench/results/comm_topology.json"
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
