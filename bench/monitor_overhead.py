"""Monitoring overhead: samples/s with full monitoring vs none, alternated in one process.

  python bench/monitor_overhead.py [--rounds 4] [--steps 1500]
"full" = monitor (system samples, the three-detector ensemble with its background fits, gathers),
healing policies and the Prometheus endpoint; "full+tracing" adds OpenTelemetry spans written to a
file; "none" = monitor and healing off. All keep metrics.jsonl. One process (the gather is a local
no-op here); the digits example's model; throughput = samples / wall time of fit().
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
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--hidden", default="128,128", help="MLP widths: a bigger model, a longer step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = f"train.steps={args.steps}"
    model = f"model.hidden=[{args.hidden}]"
    configs = {
        "none": ["monitor.enabled=false", "heal.enabled=false", steps, model],
        "full": [steps, model, "monitor.prometheus_port=0"],
        "full+tracing": [steps, model, "monitor.prometheus_port=0", "monitor.tracing=true"],
    }
    throughput(configs["none"])  # warm-up: imports, allocator, caches
    sps: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):  # alternate, so machine noise hits every config alike
        for name, sets in configs.items():
            sps[name].append(throughput(sets))
    ratios = {name: [a / b for a, b in zip(sps[name], sps["none"], strict=True)] for name in configs}
    result = {
        "steps": args.steps,
        "hidden": args.hidden,
        "rounds": args.rounds,
        "samples_per_s": sps,
        "ratio_to_none": ratios,
        "median_ratio": {name: statistics.median(r) for name, r in ratios.items()},
    }
    print(f"{'config':<14}{'median samples/s':>18}{'median ratio':>14}  per-round ratios")
    for name in configs:
        per = " ".join(f"{r:.2f}" for r in ratios[name])
        print(f"{name:<14}{statistics.median(sps[name]):>18.0f}{result['median_ratio'][name]:>14.3f}  {per}")
    suffix = "" if args.hidden == "128,128" else "_" + args.hidden.replace(",", "x")
    out = Path(__file__).parent / "results" / f"monitor_overhead{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
