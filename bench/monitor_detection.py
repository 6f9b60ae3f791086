"""Detection quality: recall and time to detection over injected faults, false alarms on clean runs.

Runs the digits example (one process, in-process Trainer) with the default monitor ensemble:
  python bench/monitor_detection.py [--runs 20] [--clean-runs 10]
Each faulty run injects one fault of its kind at a random step in [120, steps - 80); a fault counts
as detected when the ensemble alarms within 10 steps of it. (The digits example's cosine schedule
takes the LR to ~0 by the last steps: an LR × 100 there stays below the peak LR and changes
nothing, so faults are placed where they are faults.) Healing is off (pure detection), except that
NaN runs keep skip_spike so one NaN update does not poison every later step.

The learned detectors fit in a thread here (`monitor.fit_in = "thread"`): a run of 300 digits steps
lasts ~0.3 s, and a fit queued at step 100 in the default helper process (a fork of this one, on
Linux) often finishes after these runs end, so more alarms would be voted without the learned
detectors. `--fit-in process` measures that default.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from _common import write_result
from vatra.assembly import build_plugins
from vatra.config import load_config
from vatra.engine import Trainer
from vatra.rundir import RunDir, read_jsonl

WINDOW = 10
BASE = [
    "run.progress=off",
    "run.tensorboard=false",
    "checkpoint.enabled=false",
    "monitor.report=false",
    "dist.nproc=1",
]


VOTERS: list[int] = []  # per anomaly event: how many detectors were ready (scored) when it fired


def run(sets: list[str]) -> tuple[list[int], int]:
    cfg = load_config("examples/digits.toml", [*BASE, *sets])
    with tempfile.TemporaryDirectory() as tmp:
        rd = RunDir(Path(tmp)).create()
        Trainer.from_config(cfg, plugins=build_plugins(cfg, rd), run_dir=rd).fit()
        events = [e for e in read_jsonl(rd.events) if e["event"] == "anomaly"]
        VOTERS.extend(len(e.get("scores", {})) for e in events if e["detectors"] != ["nonfinite"])
        alarms = [e["step"] for e in events]
    return alarms, cfg.train.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20, help="faults (runs) per kind")
    parser.add_argument("--clean-runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--clean-steps", type=int, default=600)
    parser.add_argument("--fit-in", choices=["thread", "process"], default="thread")
    args = parser.parse_args()
    BASE.append(f"monitor.fit_in={args.fit_in}")
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    kinds = {
        "nan": lambda s: ["heal.enabled=true", 'heal.policies=["skip_spike"]', f"chaos.inject_nan_at=[{s}]"],
        "grad_spike": lambda s: ["heal.enabled=false", f"chaos.grad_spike_at=[{s}]"],
        "lr_spike": lambda s: ["heal.enabled=false", f"chaos.lr_spike_at=[{s}]", "chaos.lr_spike_steps=5"],
    }
    results: dict[str, dict] = {}
    for kind, sets in kinds.items():
        latencies, missed = [], 0
        for seed in range(args.runs):
            fault = int(rng.integers(120, args.steps - 80))
            alarms, _ = run([f"run.seed={seed}", f"train.steps={args.steps}", *sets(fault)])
            hits = [a - fault for a in alarms if fault <= a < fault + WINDOW]
            if hits:
                latencies.append(min(hits))
            else:
                missed += 1
        results[kind] = {
            "faults": args.runs,
            "detected": args.runs - missed,
            "recall": (args.runs - missed) / args.runs,
            "median_steps_to_detect": statistics.median(latencies) if latencies else None,
            "max_steps_to_detect": max(latencies) if latencies else None,
        }
    false_alarms = steps = 0
    for seed in range(args.clean_runs):
        alarms, n = run([f"run.seed={100 + seed}", f"train.steps={args.clean_steps}", "heal.enabled=false"])
        false_alarms += len(alarms)
        steps += n
    results["clean"] = {
        "steps": steps,
        "false_alarms": false_alarms,
        "per_1000_steps": 1000 * false_alarms / steps,
    }
    print(f"{'fault':<12}{'faults':>8}{'detected':>10}{'recall':>8}{'median steps':>14}{'max steps':>11}")
    for kind in kinds:
        r = results[kind]
        print(
            f"{kind:<12}{r['faults']:>8}{r['detected']:>10}{r['recall']:>8.2f}"
            f"{r['median_steps_to_detect']!s:>14}{r['max_steps_to_detect']!s:>11}"
        )
    c = results["clean"]
    print(
        f"clean: {c['false_alarms']} false alarms in {c['steps']} steps"
        f" = {c['per_1000_steps']:.2f} per 1,000 steps"
    )
    results["fit_in"] = args.fit_in
    results["ready_detectors_per_alarm"] = {str(k): VOTERS.count(k) for k in sorted(set(VOTERS))}
    print(
        f"fits in a {args.fit_in}; ready detectors per (finite) alarm: {results['ready_detectors_per_alarm']}"
    )
    results["wall_s"] = time.perf_counter() - t0
    suffix = "" if args.fit_in == "thread" else "_process"
    write_result(f"monitor_detection{suffix}", results)
    print(f"{results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
