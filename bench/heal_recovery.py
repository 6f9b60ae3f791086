"""Healing on the flagship: accuracy after LR spikes against the clean run, and false actions.

  python bench/heal_recovery.py [--nproc 2] [--clean-seeds 5]

Every run is the digits example as a user starts it (``vatra train examples/digits.toml --nproc N``:
gloo ranks, the example's checkpointing and evaluation, 300 steps; only the report is off), one
after another. For seed 0: the clean run and runs with LR spikes (``chaos.lr_spike_at``, × 100 for
10 steps, tied to the data of those steps: at 60, at 60 and 150, and at 60 and 150 with only the
rollback policy, whose loss-stream rule must then act), each reported as final validation accuracy
(summary.json) against the clean run's, with the rollbacks (from → to step, LR scale), skipped
updates and LR restores. For ``--clean-seeds`` seeds (0 included): the healing actions of clean
runs that change the training (skips and rollbacks; straggler and prefetch notes are not counted)
are false actions, target 0. Two ranks by default: this machine has 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import print_table, write_result

ROOT = Path(__file__).resolve().parents[1]
CHANGES = ("skip_update", "rollback")  # actions that change the training


def run(nproc: int, seed: int, sets: list[str]) -> dict[str, Any]:
    """One launched run: its summary and its healing events."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "vatra", "train", "examples/digits.toml", "--nproc", str(nproc)]
        cmd += ["--run-dir", f"{tmp}/run"]
        for item in ["run.progress=off", "monitor.report=false", f"run.seed={seed}", *sets]:
            cmd += ["--set", item]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        summary = json.loads(Path(f"{tmp}/run/summary.json").read_text())
        events = [json.loads(line) for line in Path(f"{tmp}/run/events.jsonl").read_text().splitlines()]
    heal = [e for e in events if e["event"] == "heal"]
    rollbacks = [e["evidence"] for e in heal if e["action"] == "rollback"]
    return {
        "val_accuracy": summary["val_accuracy"],
        "steps": summary["steps"],
        "actions": summary.get("heal_actions", {}),
        "false_actions": sum(e["action"] in CHANGES for e in heal),
        "rollbacks": [
            {k: r.get(k) for k in ("from_step", "to_step", "lr_scale", "skipped_steps_of_data", "source")}
            for r in rollbacks
        ],
        "reasons": [e["reason"] for e in heal if e["action"] in CHANGES],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--clean-seeds", type=int, default=5)
    args = parser.parse_args()
    t0 = time.perf_counter()
    clean = {seed: run(args.nproc, seed, []) for seed in range(args.clean_seeds)}
    two = "chaos.lr_spike_at=[60,150]"
    variants = {
        "LR spike at 60": ["chaos.lr_spike_at=[60]"],
        "LR spikes at 60, 150": [two],
        # without skip_spike, so that the loss streams' divergence rule must act
        "LR spikes at 60, 150, rollback only": [two, 'heal.policies=["rollback"]'],
    }
    faulty = {name: run(args.nproc, 0, sets) for name, sets in variants.items()}
    reference = clean[0]["val_accuracy"]
    rows = [["clean (seed 0)", reference, 0.0, 0, 0, 0, ""]]
    for name, r in faulty.items():
        moves = " ".join(f"{b['from_step']}→{b['to_step']}×{b['lr_scale']:g}" for b in r["rollbacks"])
        a = r["actions"]
        row = [name, r["val_accuracy"], r["val_accuracy"] - reference]
        rows.append([*row, a.get("rollback", 0), a.get("skip_update", 0), a.get("lr_restore", 0), moves])
    print_table(["run", "val accuracy", "Δ clean", "rollbacks", "skips", "LR restores", "from→to ×LR"], rows)
    false = sum(r["false_actions"] for r in clean.values())
    steps = sum(r["steps"] for r in clean.values())
    print(f"clean runs: {false} false actions in {len(clean)} runs ({steps} steps), seeds 0-{len(clean) - 1}")
    for seed, r in clean.items():
        if r["false_actions"]:
            print(f"  seed {seed}: {r['reasons']}")
    result = {
        "nproc": args.nproc,
        "clean": {str(s): r for s, r in clean.items()},
        "faulty": faulty,
        "false_actions": false,
        "clean_steps": steps,
        "wall_s": time.perf_counter() - t0,
    }
    write_result(f"heal_recovery_nproc{args.nproc}", result)
    print(f"{result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
