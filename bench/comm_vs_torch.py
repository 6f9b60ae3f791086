"""vatra's compression against plain DDP and torch's own hooks on a slow network, side by side.

    python bench/comm_vs_torch.py                      (root; 4 hosts × 1 and 2 hosts × 2, ~70 min)
    python bench/comm_vs_torch.py --layout 4x1 --methods "torch powersgd" "vatra onebit"
    python bench/comm_vs_torch.py --local              (no cluster: 4 local processes, no link bytes)

Every host's link shaped to 100 Mbit/s both ways; the 5.4 M-parameter MLP of bench/comm_compression.py
on ``synthetic``; SGD lr 0.1, momentum 0.9, cosine over 200 steps, no LR warm-up, the same seed, data
and target for every row. Rows:

* ``ddp fp32``: ``comm.method = none``, DDP's built-in all-reduce, overlapped with backward;
* ``torch fp16`` / ``torch powersgd``: torch's ``fp16_compress_hook`` and ``powerSGD_hook`` (rank 4,
  warm start, error feedback, compressing from step 2; one DDP bucket, which it needs on gloo);
* ``floor``: a hook that sends nothing, so its step time is the compute floor;
* ``vatra <method>``: only ``comm.method`` set — every other setting is the method's default recipe
  (on 2 × 2, topology ``auto`` is hierarchical: reduced inside the host, compressed between hosts);
  ``vatra <method> sync`` (pass it in ``--methods``): the same with ``comm.overlap = false``;
  ``vatra powersgd r4``: vatra's PowerSGD at torch's rank 4 (its default is 16); ``vatra powersgd
  int8``: its factors in int8 (``comm.factor_dtype``; fp16 by default).

Time to target = summed step time up to the first evaluation at or above the target (evaluation
excluded). Cross-host MB/step = what the kernel counted on the hosts' links (all headers), per host.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from _comm_cluster import train_local, train_on_cluster
from _common import write_result
from comm_compression import summarise
from vatra.launch.cluster import Cluster, ClusterSpec

TORCH = {"ddp fp32": None, "torch fp16": "fp16", "torch powersgd": "powersgd", "floor": "floor"}
VATRA = ["fp16", "bf16", "topk", "randomk", "onebit", "qsgd", "powersgd"]
# r4: torch's rank; int8: comm.factor_dtype = int8
METHODS = [*TORCH, *(f"vatra {m}" for m in VATRA), "vatra powersgd r4", "vatra powersgd int8"]
SYNC = [f"vatra {m} sync" for m in VATRA]  # the same with comm.overlap = false: what overlap buys
LAYOUTS = {"4x1": (4, 1), "2x2": (2, 2)}


def run_sets(name: str) -> tuple[list[str], str | None]:
    """The overrides of one row, and the torch hook it runs (None: vatra's own plugin)."""
    if name in TORCH:
        single = ["dist.bucket_cap_mb=64"] if name == "torch powersgd" else []
        # flat: on several hosts of several processes topology auto is vatra's hierarchical
        # all-reduce, which is a hook of its own (torch's could not be registered beside it)
        return ["comm.method=none", "comm.topology=flat", *single], TORCH[name]
    method = name.removeprefix("vatra ").removesuffix(" sync").removesuffix(" r4").removesuffix(" int8")
    extra = ["comm.overlap=false"] if name.endswith(" sync") else []
    extra += ["comm.rank=4"] if name.endswith(" r4") else []
    extra += ["comm.factor_dtype=int8"] if name.endswith(" int8") else []
    return [f"comm.method={method}", *extra], None


def table(rows: list[dict[str, Any]], where: str, target: float) -> None:
    ref = next((r for r in rows if r["method"] == "torch powersgd"), None)
    ddp = next((r for r in rows if r["method"] == "ddp fp32"), None)
    floor = next((r for r in rows if r["method"] == "floor"), None)
    print(f"\n{where} at 100 Mbit/s, target val accuracy {target:.2f}")
    print(
        f"{'method':<16} {'to target s':>11} {'vs torch psgd':>13} {'final acc':>9} {'vs ddp':>7} "
        f"{'x-host MB/step':>14} {'s/step':>7} {'floor s/step':>12}"
    )
    for r in rows:
        ttt = r["time_to_target_s"]
        ref_ttt = ref["time_to_target_s"] if ref else None
        r["vs_torch_powersgd"] = ref_ttt / ttt if ref_ttt and ttt else None
        r["acc_vs_ddp"] = r["final_val_accuracy"] - ddp["final_val_accuracy"] if ddp else None
        r["floor_s_per_step"] = floor["s_per_step"] if floor else None
        acc = "–" if r["method"] == "floor" else f"{r['final_val_accuracy']:.3f}"
        delta = "–" if r["acc_vs_ddp"] is None or r["method"] == "floor" else f"{100 * r['acc_vs_ddp']:+.1f}"
        print(
            f"{r['method']:<16} {ttt if ttt is not None else float('nan'):>11.1f} "
            f"{r['vs_torch_powersgd'] or float('nan'):>12.2f}× {acc:>9} {delta:>7} "
            f"{r['link_tx_bytes_per_step'] / 1e6:>14.2f} {r['s_per_step']:>7.2f} "
            f"{r['floor_s_per_step'] or float('nan'):>12.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--methods", nargs="*", default=METHODS, choices=METHODS + SYNC)
    ap.add_argument("--bandwidth", default="100mbit")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.40, help="validation accuracy to reach")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra override, every row")
    ap.add_argument("--local", action="store_true", help="no cluster: 4 local processes")
    ap.add_argument("--out", default="comm_vs_torch", help="result name under bench/results/")
    args = ap.parse_args()
    sets = [
        f"train.steps={args.steps}", f"train.eval_every={args.eval_every}", "train.batch_size=64",
        "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0.9", "optim.schedule=cosine",
        "optim.warmup_steps=0", "data.sharding=random", "run.seed=0", *args.extra,
    ]  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {}
    for layout in ["local"] if args.local else args.layout:
        hosts, procs = LAYOUTS.get(layout, (4, 1))
        cluster = None
        if not args.local:
            spec = ClusterSpec(name="vbtorch", hosts=hosts, bandwidth=args.bandwidth, procs_per_host=procs)
            cluster = Cluster.up(spec)
        rows: list[dict[str, Any]] = []
        try:
            with tempfile.TemporaryDirectory(prefix="vatra-bench-") as tmp:
                for name in args.methods:
                    run_dir = Path(tmp) / name.replace(" ", "_")
                    extra, hook = run_sets(name)
                    if cluster is None:
                        res = train_local(4, run_dir, sets + extra, timeout=2400, torch_hook=hook)
                    else:
                        res = train_on_cluster(cluster, run_dir, sets + extra, timeout=2400, torch_hook=hook)
                    rows.append(summarise(name, res, args.target) | {"settings": extra, "hook": hook})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            if cluster is not None:
                Cluster.down("vbtorch")
        where = "4 local processes, no shaping" if args.local else f"{hosts} hosts × {procs} processes"
        table(rows, where, args.target)
        results[layout] = rows
    write_result(args.out, {"args": vars(args), "layouts": results})


if __name__ == "__main__":
    main()
