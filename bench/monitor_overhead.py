"""Monitoring overhead: samples/s with full monitoring vs none, alternated in one process.

  python bench/monitor_overhead.py [--pairs 5] [--steps 600]
"Full" = monitor (system samples, ensemble of three detectors, gathers), healing policies,
Prometheus endpoint and OpenTelemetry spans to a file; "none" = monitor and healing off. Both keep
metrics.jsonl. One process (the gather is a local no-op here); digits example model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from vatra.config import load_config
from vatra.engine import Trainer
from vatra.launch import free_port
from vatra.rundir import RunDir
from vatra.worker import build_plugins

BASE = ["run.progress=off", "run.tensorboard=false", "checkpoint.enabled=false", "monitor.report=false"]
BASE += ["dist.nproc=1", "train.eval_every=0"]


def throughput(sets: list[str]) -> float:
    cfg = load_config("examples/digits.toml", [*BASE, *sets])
    with tempfile.TemporaryDirectory() as tmp:
        rd = RunDir(Path(tmp)).create()
        summary = Trainer.from_config(cfg, plugins=build_plugins(cfg, rd), run_dir=rd).fit()
    return summary["samples_seen"] / summary["wall_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = f"train.steps={args.steps}"
    none = ["monitor.enabled=false", "heal.enabled=false", steps]
    throughput(none)  # warm-up: imports, allocator, caches
    ratios, full_sps, none_sps = [], [], []
    for _ in range(args.pairs):
        a = throughput(none)
        full = [steps, f"monitor.prometheus_port={free_port()}", "monitor.tracing=true"]
        b = throughput(full)
        none_sps.append(a)
        full_sps.append(b)
        ratios.append(b / a)
    result = {
        "steps": args.steps,
        "pairs": args.pairs,
        "none_samples_per_s": none_sps,
        "full_samples_per_s": full_sps,
        "ratios": ratios,
        "median_ratio": statistics.median(ratios),
    }
    print(f"{'pair':<6}{'none samples/s':>16}{'full samples/s':>16}{'ratio':>8}")
    for i, (a, b, r) in enumerate(zip(none_sps, full_sps, ratios, strict=True)):
        print(f"{i:<6}{a:>16.0f}{b:>16.0f}{r:>8.3f}")
    print(f"median ratio full/none: {result['median_ratio']:.3f}")
    out = Path(__file__).parent / "results" / "monitor_overhead.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
