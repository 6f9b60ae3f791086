"""1-bit Adam with only ``comm.method`` set: digits (AdamW) on 2 gloo ranks, each method against
``none`` at the same step budget: validation accuracy, the gap in points, bytes and the bytes ratio.

    python bench/comm_adam1bit.py                        (2,000 steps: about 6 minutes on 2 cores)
    python bench/comm_adam1bit.py --steps 300 --methods topk

Same arithmetic as ``vatra train examples/digits.toml --nproc 2 --set train.steps=N --set
comm.method=M`` (without checkpoints and the monitor, which do not change it).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from _common import print_table, run_ranks, write_result

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.toml"
METHODS = ["none", "onebit", "topk", "randomk"]
QUIET = ["run.progress=off", "run.tensorboard=false", "checkpoint.enabled=false", "monitor.enabled=false"]


def _runs(ctx: Any, methods: list[str], steps: int) -> dict[str, dict[str, Any]]:
    from vatra.comm.plugin import CommPlugin
    from vatra.config import load_config
    from vatra.engine import Trainer

    results = {}
    for method in methods:
        cfg = load_config(EXAMPLE, [*QUIET, f"train.steps={steps}", f"comm.method={method}"])
        summary = Trainer.from_config(cfg, dist=ctx, plugins=[CommPlugin(cfg.comm)]).fit()
        keep = ("val_accuracy", "comm_bytes", "compression_started_step")
        results[method] = {k: summary.get(k) for k in keep}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--methods", nargs="*", default=METHODS[1:], choices=METHODS)
    args = ap.parse_args()
    methods = ["none", *(m for m in args.methods if m != "none")]
    r = run_ranks(_runs, 2, methods, args.steps)
    none = r["none"]
    rows = [
        [
            m,
            r[m]["val_accuracy"],
            f"{100 * (r[m]['val_accuracy'] - none['val_accuracy']):+.1f}",
            r[m]["comm_bytes"],
            f"{none['comm_bytes'] / r[m]['comm_bytes']:.1f}×",
            r[m]["compression_started_step"],
        ]
        for m in methods
    ]
    print_table(["method", "val accuracy", "vs none (pt)", "comm_bytes", "fewer bytes", "frozen at"], rows)
    write_result("comm_adam1bit", {"steps": args.steps, "runs": r})


if __name__ == "__main__":
    main()
