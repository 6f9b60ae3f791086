"""The adaptive batch (gradient noise scale) against fixed batches, the whole `vatra train` path.

    python bench/adaptive_batch.py [--reps 2] [--nproc 2]

examples/digits.toml with a wider MLP (1024-1024-1024, where a step's compute grows with its batch)
on ``--nproc`` local ranks, 400 steps, an evaluation every 20. Rows, in one run, their order rotated
rep by rep so machine noise hits each alike:

* ``fixed-small``: plain DDP at the starting global batch (16 per rank), the config's LR;
* ``fixed-large``: plain DDP at the adaptive run's largest allowed global batch (8×), the LR scaled
  by the same rule the adaptive run uses (× sqrt(8) for AdamW);
* ``adaptive``: ``balance.adaptive`` from the small batch up to the large one, following the noise
  scale, the LR following the batch.

Reported: time to target (summed step time up to the first evaluation at or above the target),
steps and samples to target, final accuracy, the last global batch and noise scale. Step times
on 2 cores include CPU contention between ranks; ratios, not absolute times, are the result.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
PER_RANK = 16
GROWTH = 8  # max_global_batch = GROWTH × the starting one
LR = 0.003  # examples/digits.toml
TARGET = 0.97
MODES = ("fixed-small", "fixed-large", "adaptive")


def run_once(mode: str, nproc: int, out: Path) -> dict[str, Any]:
    sets = [
        f"run.out_dir={out}",
        "run.progress=off",
        "run.tensorboard=false",
        "checkpoint.enabled=false",
        "monitor.enabled=false",
        "train.steps=400",
        "train.eval_every=20",
        "model.hidden=[1024, 1024, 1024]",
        "data.sharding=random",
    ]
    if mode == "fixed-small":
        sets.append(f"train.batch_size={PER_RANK}")
    elif mode == "fixed-large":
        sets += [f"train.batch_size={PER_RANK * GROWTH}", f"optim.lr={LR * math.sqrt(GROWTH)}"]
    else:
        sets += [
            f"train.batch_size={PER_RANK}",
            "balance.method=static",
            "balance.adaptive=true",
            f"balance.max_global_batch={PER_RANK * nproc * GROWTH}",
        ]
    cmd = [sys.executable, "-m", "vatra", "train", "examples/digits.toml", "--nproc", str(nproc)]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{done.stderr[-3000:]}")
    (run,) = out.iterdir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    elapsed, samples, to_target, at = 0.0, 0, None, None
    for row in rows:
        elapsed += row["step_time_s"]
        samples += row.get("global_batch", PER_RANK * nproc * (GROWTH if mode == "fixed-large" else 1))
        if to_target is None and row.get("val_accuracy", 0.0) >= TARGET:
            to_target, at = elapsed, (row["step"], samples)
    last = rows[-1]
    return {
        "time_to_target_s": to_target,
        "steps_to_target": at[0] if at else None,
        "samples_to_target": at[1] if at else None,
        "train_s": elapsed,
        "final_val_accuracy": summary.get("val_accuracy"),
        "last_global_batch": last.get("global_batch"),
        "last_noise_scale": next((r["noise_scale"] for r in reversed(rows) if "noise_scale" in r), None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default="adaptive_batch")
    args = ap.parse_args()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        shift = rep % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            with tempfile.TemporaryDirectory() as tmp:
                r = run_once(mode, args.nproc, Path(tmp))
            results[mode].append(r)
            print(json.dumps({"mode": mode, "rep": rep, **r}), flush=True)

    def med(runs: list[dict[str, Any]], key: str) -> float | None:
        vals = [r[key] for r in runs if r[key] is not None]
        return statistics.median(vals) if len(vals) == len(runs) else None

    base = med(results["fixed-small"], "time_to_target_s")
    table = []
    for mode, runs in results.items():
        ttt = med(runs, "time_to_target_s")
        table.append(
            [
                mode,
                f"{ttt:.1f}" if ttt is not None else "not reached",
                f"{base / ttt:.2f}×" if base and ttt else "n/a",
                str(med(runs, "steps_to_target") or "n/a"),
                str(med(runs, "samples_to_target") or "n/a"),
                f"{statistics.median(r['train_s'] for r in runs):.1f}",
                f"{statistics.median(r['final_val_accuracy'] for r in runs):.4f}",
                str(runs[-1]["last_global_batch"] or ""),
                f"{runs[-1]['last_noise_scale']:.0f}" if runs[-1]["last_noise_scale"] else "",
            ]
        )
    print_table(
        [
            "mode",
            "to target s",
            "vs fixed-small",
            "steps",
            "samples",
            "train s",
            "final acc",
            "last batch",
            "noise scale",
        ],
        table,
    )
    write_result(args.out, {"nproc": args.nproc, "target": TARGET, "results": results})


if __name__ == "__main__":
    main()
