"""Monitoring overhead: samples/s with full monitoring vs none, alternated in one process.

  python bench/monitor_overhead.py [--rounds 4] [--steps 6000] [--hidden 128,128]
  python bench/monitor_overhead.py --nproc 4 [--rounds 4] [--steps 1000]

With ``--nproc N`` every run is the flagship as a user starts it (``vatra train examples/digits.toml
--nproc N``: N gloo ranks, the example's checkpointing and evaluation kept), differing only in the
config below; samples/s is ``samples_seen / wall_s`` of rank 0's ``fit()`` from summary.json, CPU
is that of every process of the run (launcher, ranks, fit helper).

Configs, all keeping metrics.jsonl:
  none          monitor and healing off;
  monitor       metrics, gathers, system samples, the three-detector ensemble (fits in its helper
                process), healing off;
  full          monitor + healing policies + the Prometheus endpoint (the default run, plus /metrics);
  full+tracing  full + OpenTelemetry spans written to a file.
One process (the gather is a local no-op here), one CPU thread, checkpointing off (healing then keeps
in-memory snapshots), the digits example's data. Per run: samples / wall time of fit() (the issue's
figure), and CPU seconds per step of this process plus its reaped children (the fit helper) — CPU
time is steadier than wall time when other work shares the machine. Runs are long enough to include
the warm-up fit and refits (every monitor.refit_every = 2000 clean steps) as a real run pays them.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from _common import write_result
from vatra.assembly import build_plugins
from vatra.config import load_config
from vatra.engine import Trainer
from vatra.rundir import RunDir

BASE = ["run.progress=off", "run.tensorboard=false", "checkpoint.enabled=false", "monitor.report=false"]
BASE += ["dist.nproc=1", "train.eval_every=0"]


def cpu_seconds() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def measure(sets: list[str]) -> tuple[float, float]:
    """(samples/s over fit()'s wall time, CPU ms per step) of one run."""
    cfg = load_config("examples/digits.toml", [*BASE, *sets])
    with tempfile.TemporaryDirectory() as tmp:
        rd = RunDir(Path(tmp)).create()
        trainer = Trainer.from_config(cfg, plugins=build_plugins(cfg, rd), run_dir=rd)
        cpu0, wall0 = cpu_seconds(), time.perf_counter()
        summary = trainer.fit()  # closes the fit helper (reaped: its CPU is in RUSAGE_CHILDREN)
        cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
    return summary["samples_seen"] / wall, 1000 * cpu / summary["steps"]


def measure_launched(sets: list[str], nproc: int) -> tuple[float, float]:
    """(samples/s over rank 0's fit() wall time, CPU ms per step of all the run's processes)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "vatra", "train", "examples/digits.toml", "--nproc", str(nproc)]
        cmd += ["--run-dir", f"{tmp}/run"]
        for item in ["run.progress=off", "monitor.report=false", *sets]:
            cmd += ["--set", item]
        cpu0 = cpu_seconds()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        cpu = cpu_seconds() - cpu0
        summary = json.loads(Path(f"{tmp}/run/summary.json").read_text())
    return summary["samples_seen"] / summary["wall_s"], 1000 * cpu / summary["steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--hidden", default="128,128", help="MLP widths: a bigger model, a longer step")
    parser.add_argument("--nproc", type=int, default=1, help="> 1: the flagship run on N ranks via the CLI")
    args = parser.parse_args()
    torch.set_num_threads(1)
    common = [f"train.steps={args.steps}", f"model.hidden=[{args.hidden}]"]
    configs = {
        "none": ["monitor.enabled=false", "heal.enabled=false", *common],
        "monitor": ["heal.enabled=false", *common],
        "full": [*common, "monitor.prometheus_port=0"],
        "full+tracing": [*common, "monitor.prometheus_port=0", "monitor.tracing=true"],
    }
    run: Callable[[list[str]], tuple[float, float]] = measure
    if args.nproc > 1:
        configs.pop("full+tracing")  # off by default; its cost is measured in the one-process mode
        run = functools.partial(measure_launched, nproc=args.nproc)
    else:
        measure(configs["none"])  # warm-up: imports, allocator, caches
    sps: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):  # alternate, so machine noise hits every config alike
        for name, sets in configs.items():
            s, c = run(sets)
            sps[name].append(s)
            cpu[name].append(c)
    ratios = {name: [a / b for a, b in zip(sps[name], sps["none"], strict=True)] for name in configs}
    cpu_ratios = {name: [b / a for a, b in zip(cpu[name], cpu["none"], strict=True)] for name in configs}
    result = {
        "steps": args.steps,
        "hidden": args.hidden,
        "rounds": args.rounds,
        "nproc": args.nproc,
        "samples_per_s": sps,
        "cpu_ms_per_step": cpu,
        "ratio_to_none": ratios,
        "cpu_ratio_to_none": cpu_ratios,
        "median_ratio": {name: statistics.median(r) for name, r in ratios.items()},
        "median_cpu_ratio": {name: statistics.median(r) for name, r in cpu_ratios.items()},
    }
    print(
        f"{'config':<14}{'samples/s':>11}{'ratio':>8}{'CPU ms/step':>13}{'CPU ratio':>11}"
        "  per-round samples/s ratios"
    )
    for name in configs:
        per = " ".join(f"{r:.2f}" for r in ratios[name])
        print(
            f"{name:<14}{statistics.median(sps[name]):>11.0f}{result['median_ratio'][name]:>8.3f}"
            f"{statistics.median(cpu[name]):>13.3f}{result['median_cpu_ratio'][name]:>11.3f}  {per}"
        )
    suffix = "" if args.hidden == "128,128" else "_" + args.hidden.replace(",", "x")
    suffix += f"_nproc{args.nproc}" if args.nproc > 1 else ""
    write_result(f"monitor_overhead{suffix}", result)


if __name__ == "__main__":
    main()
