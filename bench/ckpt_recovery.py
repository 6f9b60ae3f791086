"""Recovery after kill -9 on the digits example (4 ranks): seconds from death to training again.

Runs ``vatra train examples/digits.toml --nproc 4 --max-restarts 1`` with rank 1 SIGKILLed by
``chaos.kill_at_steps`` R times, and once undisturbed (the baseline), and reads the events the run
folders record: recovery_s (the dead rank's last completed step → the first completed step after
the resume), split into phases (kill → the agent's failure report, which waits for the survivors
to exit; report → the new attempt's first event; → its first completed step), and steps_lost
(≤ checkpoint.every_steps by construction). The extra wall time of a killed run over the
undisturbed one is the whole cost of the failure.

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
            (kill,) = events(run, "chaos_kill")
            (dead,) = events(run, "worker_failed")
            restart = events(run, "attempt_start")[-1]
            summary = json.loads((run / "summary.json").read_text())
            # where the time goes: survivors exit → agent reports; new group starts; first step
            phases = (
                dead["time"] - kill["time"],
                restart["time"] - dead["time"],
                rec["time"] - restart["time"],
            )
            runs.append(
                {
                    "kill_to_agent_report_s": phases[0],
                    "report_to_new_attempt_s": phases[1],
                    "new_attempt_to_first_step_s": phases[2],
                    "recovery_s": rec["recovery_s"],
                    "steps_lost": rec["steps_lost"],
                    "wall_s": wall,
                    "extra_wall_s": wall - base_wall,
                    "val_accuracy": summary["val_accuracy"],
                }
            )
            rows.append(
                [i, rec["recovery_s"], *phases, rec["steps_lost"], wall - base_wall, summary["val_accuracy"]]
            )
    rec_med = statistics.median(r["recovery_s"] for r in runs)
    every = load_config(ROOT / "examples" / "digits.toml").checkpoint.every_steps
    lost_max = max(r["steps_lost"] for r in runs)
    heads = ["run", "recovery s", "kill→agent s", "agent→restart s", "restart→step s", "steps lost"]
    print_table([*heads, "extra wall s", "val acc"], rows)
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
