"""Every compression method with only ``comm.method`` set, on examples/digits.toml (2 gloo ranks).

    python bench/comm_recipe.py                 (about 8 minutes on 2 cores)
    python bench/comm_recipe.py --methods none topk

The whole table of the suite's ``test_comm_recipe`` check (which keeps one method per family): the
validation accuracy of each method after the example's 300 AdamW steps, and its gap to ``none``
(360 validation images: 1 point ≈ 4 images). Before the recipes, topk ended 3.6 points behind,
onebit 1.7, randomk 2.8, qsgd 1.4 and powersgd 0.8.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from _common import print_table, run_ranks, write_result

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits.toml"
METHODS = ["none", "fp16", "bf16", "topk", "randomk", "onebit", "qsgd", "powersgd"]
QUIET = ["run.progress=off", "run.tensorboard=false", "checkpoint.enabled=false", "monitor.enabled=false"]


def _accuracies(ctx: Any, methods: list[str]) -> dict[str, float]:
    from vatra.comm.plugin import CommPlugin
    from vatra.config import load_config
    from vatra.engine import Trainer

    results = {}
    for method in methods:
        cfg = load_config(EXAMPLE, [*QUIET, f"comm.method={method}"])
        summary = Trainer.from_config(cfg, dist=ctx, plugins=[CommPlugin(cfg.comm)]).fit()
        results[method] = summary["val_accuracy"]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", nargs="*", default=METHODS, choices=METHODS)
    args = ap.parse_args()
    methods = ["none", *(m for m in args.methods if m != "none")]
    acc = run_ranks(_accuracies, 2, methods)
    rows = [[m, acc[m], f"{100 * (acc[m] - acc['none']):+.1f}"] for m in methods]
    print_table(["method", "val accuracy", "vs none (pt)"], rows)
    write_result("comm_recipe", {"accuracy": acc})


if __name__ == "__main__":
    main()
