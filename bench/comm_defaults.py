"""Compression with only ``comm.method`` set: accuracy against ``none`` and bytes saved, per run.

    python bench/comm_defaults.py                  (every run but gpt_text-2k: ~15 min on 2 cores)
    python bench/comm_defaults.py --runs digits-2k --methods none topk
    python bench/comm_defaults.py --runs digits-2k --seeds 0 1 2 3 4  (each cell the mean of 5 seeds)

Each cell is one ``vatra train CONFIG --nproc N --set comm.method=METHOD`` (plus the run's own
sets), its ``summary.json`` read back: the accuracy delta in points against ``none`` on the same
run (gpt_text: also the validation loss's relative change), the bytes ratio ``none``'s
``comm_bytes`` over the method's (warm-up included), and the step compression started at
(``compression_started_step``). Runs:

* ``digits`` / ``digits-4``: examples/digits.toml at its budget (300 AdamW steps) on 2 / 4 ranks;
* ``digits-2k``: the same on 2 ranks for 2,000 steps (issue 43's "run long enough to matter");
* ``digits-sgd-2k``: 2,000 steps under SGD (lr 0.05, momentum 0.9): DGC's side of the recipe;
* ``synthetic``: examples/synthetic.toml at its budget (400 steps, 2 ranks);
* ``gpt_text``: examples/gpt_text.toml at its budget (300 steps, 2 ranks; about a minute a cell);
* ``gpt_text-2k``: the same for 2,000 steps (not in the default set: about 6 minutes a cell).

With ``--seeds``, every cell runs once per seed (``run.seed``) and shows the means, the range of
the per-seed deltas (each seed against ``none`` on the same seed) and of the start steps.

Results are merged into bench/results/comm_defaults.json run by run, so the table can be built up
with several shorter invocations (the machine has 2 cores: one at a time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import RESULTS, print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
SGD = ["optim.name=sgd", "optim.lr=0.05", "optim.momentum=0.9"]
RUNS: dict[str, tuple[str, int, list[str]]] = {
    "digits": ("examples/digits.toml", 2, []),
    "digits-2k": ("examples/digits.toml", 2, ["train.steps=2000"]),
    "digits-4": ("examples/digits.toml", 4, []),
    "digits-sgd-2k": ("examples/digits.toml", 2, ["train.steps=2000", *SGD]),
    "synthetic": ("examples/synthetic.toml", 2, []),
    "gpt_text": ("examples/gpt_text.toml", 2, []),
    "gpt_text-2k": ("examples/gpt_text.toml", 2, ["train.steps=2000"]),
}
METHODS = ["none", "topk", "onebit", "randomk"]
QUIET = ["run.progress=off", "run.tensorboard=false", "checkpoint.enabled=false", "monitor.report=false"]


def train(run: str, method: str, seed: int | None = None) -> dict[str, Any]:
    """One cell: the run with ``comm.method = method`` (and ``run.seed``); what its summary says."""
    config, nproc, sets = RUNS[run]
    seeded = [] if seed is None else [f"run.seed={seed}"]
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "vatra", "train", str(ROOT / config), "--nproc", str(nproc)]
        for s in [*sets, *QUIET, *seeded, f"run.out_dir={out}", f"comm.method={method}"]:
            args += ["--set", s]
        done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=900)
        summaries = list(Path(out).glob("*/summary.json"))
        if done.returncode or not summaries:
            raise SystemExit(f"error: {run} / {method} failed:\n{done.stderr[-2000:]}")
        s = json.loads(summaries[0].read_text())
    keys = ("val_accuracy", "val_loss", "comm_bytes", "compression_started_step", "wall_s", "steps")
    return {k: s.get(k) for k in keys}


def seeded_cell(run: str, method: str, seeds: list[int]) -> dict[str, Any]:
    """The cell over several seeds: the means, and each seed's own cell under ``per_seed``."""
    cells = {str(seed): train(run, method, seed) for seed in seeds}
    mean = {
        k: sum(c[k] for c in cells.values()) / len(cells) for k in ("val_accuracy", "val_loss", "comm_bytes")
    }
    starts = [c["compression_started_step"] for c in cells.values()]
    return {
        **mean,
        "compression_started_step": starts[0] if len(set(starts)) == 1 else starts,
        "per_seed": cells,
    }


def spread(cell: dict[str, Any], base: dict[str, Any]) -> str:
    """The range of the per-seed accuracy deltas (points), when both cells ran the same seeds."""
    mine, theirs = cell.get("per_seed", {}), base.get("per_seed", {})
    deltas = [100 * (c["val_accuracy"] - theirs[s]["val_accuracy"]) for s, c in mine.items() if s in theirs]
    return f"{min(deltas):+.1f} to {max(deltas):+.1f} ({len(deltas)} seeds)" if len(deltas) > 1 else ""


def rows_of(results: dict[str, dict[str, dict[str, Any]]]) -> list[list[Any]]:
    rows = []
    for run, cells in results.items():
        base = cells.get("none")
        for method, c in cells.items():
            if base is None or method == "none":
                rows.append([run, method, c["val_accuracy"], "", "", "", c["val_loss"], ""])
                continue
            delta = 100 * (c["val_accuracy"] - base["val_accuracy"])
            loss = 100 * (c["val_loss"] - base["val_loss"]) / base["val_loss"]
            ratio = base["comm_bytes"] / max(c["comm_bytes"], 1)
            start = c["compression_started_step"]
            if isinstance(start, list):
                start = f"{min(start)}-{max(start)}"
            rows.append(
                [run, method, c["val_accuracy"], f"{delta:+.1f}", spread(c, base), f"{ratio:.1f}x",
                 f"{loss:+.1f} %", start]
            )  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = [r for r in RUNS if r != "gpt_text-2k"]
    ap.add_argument("--runs", nargs="*", default=default, choices=list(RUNS))
    ap.add_argument("--methods", nargs="*", default=METHODS)
    ap.add_argument(
        "--seeds", nargs="*", type=int, default=None, help="run.seed per cell (default: the config's)"
    )
    args = ap.parse_args()
    path = RESULTS / "comm_defaults.json"
    results: dict[str, dict[str, dict[str, Any]]] = (
        json.loads(path.read_text())["runs"] if path.exists() else {}
    )
    methods = ["none", *(m for m in args.methods if m != "none")]
    for run in args.runs:
        for method in methods:
            cell = seeded_cell(run, method, args.seeds) if args.seeds else train(run, method)
            results.setdefault(run, {})[method] = cell
            print(
                f"{run:14} {method:8} acc {cell['val_accuracy']:.4f}  bytes {cell['comm_bytes']:,}",
                flush=True,
            )
    headers = ["run", "method", "val acc", "vs none (pt)", "per seed", "bytes ratio", "val loss vs none"]
    headers.append("started at")
    print_table(headers, rows_of(results))
    write_result("comm_defaults", {"runs": results})


if __name__ == "__main__":
    main()
