"""Where monitoring's per-step time goes, measured inside a real run (not in isolation).

  python bench/monitor_hooks.py [--steps 6000] [--rounds 2]

Same setup as bench/monitor_overhead.py (one process, one CPU thread, the digits example,
checkpointing off). Each plugin hook, each healing policy and the monitor's window judgement is
wrapped in a timer, and the run's µs per step is reported next to "none" (monitor and healing
off) run alternately in the same process. The timers cost ≈ 0.2 µs per call, so the wrapped run
is a little slower than an unwrapped one; the split is what this is for. Small Python functions
cost several times more here than in a loop on their own: between two calls the training step
has evicted their code and data from the CPU caches.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import print_table, write_result
from monitor_overhead import BASE
from vatra.assembly import build_plugins
from vatra.config import load_config
from vatra.engine import Plugin, Trainer, overrides
from vatra.rundir import RunDir

CONFIGS = {"none": ["monitor.enabled=false", "heal.enabled=false"], "full": ["monitor.prometheus_port=0"]}


def _timed(fn: Callable[..., Any], label: str, spent: Counter[str]) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent[label] += time.perf_counter() - t

    return wrapper


def run(sets: list[str], steps: int) -> tuple[float, dict[str, float]]:
    """(µs per step of fit(), µs per step of each timed part) of one run."""
    cfg = load_config("examples/digits.toml", [*BASE, f"train.steps={steps}", *sets])
    spent: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        rd = RunDir(Path(tmp)).create()
        plugins = build_plugins(cfg, rd)
        for p in plugins:
            name = type(p).__name__
            for hook in ("on_step_start", "after_backward", "on_step_end"):
                if overrides(p, Plugin, hook):  # what PluginList calls
                    setattr(p, hook, _timed(getattr(p, hook), f"{name}.{hook}", spent))
            for policy in getattr(p, "policies", []):  # the healer's
                for hook in ("after_backward", "on_step_end"):
                    label = f"  {name} / {type(policy).__name__}.{hook}"
                    setattr(policy, hook, _timed(getattr(policy, hook), label, spent))
            if hasattr(p, "_gather_and_judge"):  # the monitor's every-gather_every-steps part
                p._gather_and_judge = _timed(p._gather_and_judge, f"  {name} / gather and judge", spent)
        trainer = Trainer.from_config(cfg, plugins=plugins, run_dir=rd)
        t0 = time.perf_counter()
        trainer.fit()
        wall = time.perf_counter() - t0
    return 1e6 * wall / steps, {k: 1e6 * v / steps for k, v in spent.items()}


def main() -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run(CONFIGS["none"], 500)  # warm-up: imports, allocator, caches
    step_us: dict[str, list[float]] = {name: [] for name in CONFIGS}
    parts: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, sets in CONFIGS.items():
            us, split = run(sets, args.steps)
            step_us[name].append(us)
            for k, v in split.items():
                parts.setdefault(f"{name}: {k}", []).append(v)
    med = {name: statistics.median(v) for name, v in step_us.items()}
    rows = [[f"{name}: whole step", med[name]] for name in CONFIGS]
    rows.append(["full − none", med["full"] - med["none"]])
    by_cost = sorted(parts.items(), key=lambda kv: -statistics.median(kv[1]))
    rows += [[k, statistics.median(v)] for k, v in by_cost]
    print_table(["part", "µs/step (median of rounds)"], rows)
    write_result("monitor_hooks", {"args": vars(args), "step_us": step_us, "parts_us": parts})


if __name__ == "__main__":
    main()
