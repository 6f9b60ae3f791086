"""Recovery after kill -9 on the digits example (4 ranks): seconds from death to training again.

Runs ``vatra train examples/digits.toml --nproc 4 --max-restarts 1`` with rank 1 SIGKILLed by
``chaos.kill_at_steps`` R times, and once undisturbed (the baseline), and reads the ``recovered``
events the run folders record: recovery_s (the agent noticing the death → the first completed step
after the resume) and steps_lost (≤ checkpoint.every_steps by construction). The extra wall time
of a killed run over the undisturbed one is the whole cost of the failure.

    .venv/bin/python bench/ckpt_recovery.py [--repeats 5] [--kill-at 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import print_table, write_result
from vatra.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def train(run: Path, *extra: str) -> float:
    cmd = [
        sys.executable,
        "-m",
        "vatra",
        "train",
        "examples/digits.toml",
        "--nproc",
        "4",
        "--run-dir",
        str(run),
    ]
    cmd += ["--set", "run.tensorboard=false", "--set", "run.progress=off", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    if proc.returncode != 0:
        raise SystemExit(f"run failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def events(run: Path, kind: str) -> list[dict]:
    lines = (run / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=100)
    args = ap.parse_args()
    rows, runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        base_wall = train(Path(tmp) / "base")
        base_summary = json.loads((Path(tmp) / "base" / "summary.json").read_text())
        for i in range(args.repeats):
            run = Path(tmp) / f"kill{i}"
            wall = train(run, "--set", f"chaos.kill_at_steps=[{args.kill_at}]", "--max-restarts", "1")
            (rec,) = events(run, "recovered")
            summary = json.loads((run / "summary.json").read_text())
            runs.append(
                {
                    "recovery_s": rec["recovery_s"],
                    "steps_lost": rec["steps_lost"],
                    "wall_s": wall,
                    "extra_wall_s": wall - base_wall,
                    "val_accuracy": summary["val_accuracy"],
                }
            )
            rows.append(
                [i, rec["recovery_s"], rec["steps_lost"], wall, wall - base_wall, summary["val_accuracy"]]
            )
    rec_med = statistics.median(r["recovery_s"] for r in runs)
    every = load_config(ROOT / "examples" / "digits.toml").checkpoint.every_steps
    lost_max = max(r["steps_lost"] for r in runs)
    print_table(["run", "recovery s", "steps lost", "wall s", "extra wall s", "val acc"], rows)
    print(f"undisturbed: wall {base_wall:.1f} s, val acc {base_summary['val_accuracy']:.4f}")
    print(
        f"median recovery {rec_med:.1f} s (target ≤ 15 s); max steps lost {lost_max} "
        f"(checkpoint interval {every})"
    )
    write_result(
        "ckpt_recovery",
        {
            "command": "bench/ckpt_recovery.py " + " ".join(sys.argv[1:]),
            "kill_at": args.kill_at,
            "checkpoint_every_steps": every,
            "baseline_wall_s": base_wall,
            "baseline_val_accuracy": base_summary["val_accuracy"],
            "runs": runs,
            "median_recovery_s": rec_med,
            "max_steps_lost": lost_max,
        },
    )


if __name__ == "__main__":
    main()
