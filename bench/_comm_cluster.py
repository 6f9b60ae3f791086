"""Shared by the comm benchmarks: train on the namespace cluster and read back what happened."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vatra.launch.cluster import Cluster
from vatra.rundir import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
# 5.4 M parameters: 64·2048 + 2048·2048 + 2048·512 + 512·10 weights (+ biases)
MODEL = ["--set", "model.name=mlp", "--set", "model.hidden=[2048,2048,512]"]
QUIET = ["--set", "run.progress=off", "--set", "run.tensorboard=false"]


def _argv(run_dir: Path, sets: list[str], torch_hook: str | None) -> list[str]:
    """``vatra train`` on the synthetic example with the benchmark model, or with ``torch_hook`` the
    same run through bench/_torch_hooks.py (one of torch's own DDP hooks) under ``vatra run``."""
    overrides = MODEL + QUIET + [a for s in sets for a in ("--set", s)]
    example = str(ROOT / "examples/synthetic.toml")
    if torch_hook is None:
        return ["vatra", "train", example, "--run-dir", str(run_dir), *overrides]
    script = str(ROOT / "bench/_torch_hooks.py")
    return ["vatra", "run", script, "--run-dir", str(run_dir), "--", torch_hook, example, *overrides]


def train_on_cluster(
    cluster: Cluster, run_dir: Path, sets: list[str], timeout: float, torch_hook: str | None = None
) -> dict[str, Any]:
    """One ``vatra train`` across the cluster; metrics of rank 0 plus each host's link counters."""
    before = cluster.link_bytes()
    t0 = time.perf_counter()
    argv = _argv(run_dir, sets, torch_hook)
    code = cluster.run(argv, timeout=timeout, log=run_dir.parent / f"{run_dir.name}.log")
    wall = time.perf_counter() - t0
    after = cluster.link_bytes()
    if code:
        raise RuntimeError(f"training failed (exit {code}); see {run_dir.parent / (run_dir.name + '.log')}")
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "step" in m]
    summary = json.loads((run_dir / "summary.json").read_text())
    tx = [after[h]["tx_bytes"] - before[h]["tx_bytes"] for h in after]
    return {"metrics": metrics, "summary": summary, "wall_s": wall, "link_tx_bytes": tx}


def train_local(
    nproc: int, run_dir: Path, sets: list[str], timeout: float, torch_hook: str | None = None
) -> dict[str, Any]:
    """The same ``vatra train`` on ``nproc`` local processes, unshaped loopback: the same arithmetic as
    on the cluster (same seed, data shards and collectives), so accuracy figures carry over; times and
    link bytes do not (no link counters here)."""
    t0 = time.perf_counter()
    vatra, *rest = _argv(run_dir, sets, torch_hook)
    cut = rest.index("--") if "--" in rest else len(rest)
    argv = [sys.executable, "-m", vatra, *rest[:cut], "--nproc", str(nproc), *rest[cut:]]
    log = run_dir.parent / f"{run_dir.name}.log"
    threads = str(max(1, (os.cpu_count() or 1) // nproc))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
    with log.open("w", encoding="utf-8") as sink:
        code = subprocess.run(
            argv, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, env=env
        ).returncode
    if code:
        raise RuntimeError(f"training failed (exit {code}); see {log}")
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "step" in m]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"metrics": metrics, "summary": summary, "wall_s": time.perf_counter() - t0, "link_tx_bytes": [0]}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
