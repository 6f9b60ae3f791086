"""Live recovery against restart-based recovery: ETTR and the survivors' stall under repeated faults.

  python bench/live_recovery.py [--steps 3500] [--fault-every-steps 700] [--checkpoint-every 100]
                                [--step-ms 30] [--heartbeat-ms 2000] [--together]

Two runs of the same training, one after the other (``--together``: at the same time, so both see
the same machine load), each as a user starts it (``vatra train CONFIG --nproc 2 --run-dir DIR``):
digits, an MLP, 2 processes, a checkpoint every ``--checkpoint-every`` steps. Rank 0 sleeps
``--step-ms`` per step (``chaos.slow_rank``): it stands in for compute and sets the same pace on
both sides on this shared 2-core machine (30 ms: 3,500 steps are about 2.5 minutes of steps). A
fault hits rank (group) 1 every ``--fault-every-steps`` steps (default: a fifth of the run, so four
faults), the kinds in this order, round and round:

- NaN: the data of that step makes the loss NaN (``chaos.inject_nan_at``; healing skips the update);
- kill -9 of the rank's process;
- SIGTERM to the rank's process (a preemption notice);
- slow node: the process is stopped (SIGSTOP) for 3 s, then continued.

``restart`` is today's recovery: torch's elastic agent (``--max-restarts 10``) restarts every rank
from the last checkpoint after a death, and a SIGTERM saves, stops the launch, and this script
runs the same command again (what a scheduler does after a preemption). ``live`` is
``resilience.live = true``: torchft replica groups, the dead group restarted alone and healed from
the live one. Figures: ETTR from :func:`vatra.monitor.ettr.ettr_of_run` over every launch of the
run folder (start-up included), the same without the first start-up (the recovery's own cost),
and per fault the time lost: from the fault to the next one (or the last step), the wall time less
the usual step time of the steps rank 0 gained (read from its progress file), so a stall, a
restart's recomputed steps and a relaunch all count; with live recovery also the survivors' own
stall per quorum change (``quorum_changed`` events).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import tomli_w

from _common import print_table, write_result
from vatra.monitor.ettr import ettr_of_run

ROOT = Path(__file__).resolve().parents[1]

FAULTS = ("nan", "kill -9", "SIGTERM", "slow node")
STOP_S = 3.0  # the slow node's pause
STALL_WINDOW_S = 10.0  # a stall is the fault's when it begins this soon after it


def schedule(steps: int, every: int) -> list[tuple[str, int]]:
    """(kind, step) of each fault: one every ``every`` steps before the last, kinds in turn."""
    return [(FAULTS[(n - 1) % len(FAULTS)], n * every) for n in range(1, (steps - 1) // every + 1)]


def config(
    arm: str, steps: int, step_ms: float, heartbeat_ms: int, due: list[tuple[str, int]], checkpoint_every: int
) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "run": {"name": f"live-bench-{arm}", "progress": "off"},
        "data": {"name": "digits"},
        "model": {"name": "mlp", "hidden": [128, 128]},
        "train": {"steps": steps, "batch_size": 32, "eval_every": 0},
        "optim": {"name": "adamw", "lr": 0.001},
        "dist": {"nproc": 2},
        "checkpoint": {"every_steps": checkpoint_every},
        "monitor": {"report": False},
        "heal": {"policies": ["skip_spike"]},  # what live recovery keeps; the same on both sides
        "chaos": {
            "slow_rank": 0,
            "slow_rank_s": step_ms / 1000,
            "inject_nan_at": [s for kind, s in due if kind == "nan"],
        },
    }
    if arm == "live":
        raw["resilience"] = {"live": True, "live_heartbeat_ms": heartbeat_ms}
    return raw


def _progress(run_dir: Path, rank: int) -> dict[str, Any] | None:
    try:
        return dict(json.loads((run_dir / ".ranks" / f"rank{rank}.json").read_text()))
    except (OSError, ValueError):
        return None


def stall(history: list[tuple[float, int]], start: float, end: float, usual: float) -> float:
    """Rank 0's stall after a fault at ``start``: its longest wait for a next step that begins in the
    fault's first ``STALL_WINDOW_S`` (and before ``end``), less one usual step, plus the steps it
    did again there (a restart resumes from a checkpoint). The window keeps a later, unrelated stall
    (a load spike a minute after the fault) from being charged to it."""
    before = [s for t, s in history if t <= start]
    after = [(t, s) for t, s in history if start < t <= end]
    if not before or not after:
        return 0.0
    points = [(start, before[-1]), *after]
    gaps = [
        points[i + 1][0] - points[i][0]
        for i in range(len(points) - 1)
        if points[i][0] <= start + STALL_WINDOW_S
    ]
    resumed = min(s for t, s in after if t <= start + STALL_WINDOW_S + max(gaps))
    redone = max(0, before[-1] - resumed + 1)  # steps from the resume back up to the fault's step
    return round(max(0.0, max(gaps) - usual) + redone * usual, 3)


def run_arm(arm: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run with its faults; relaunched while it stops for a SIGTERM (one launch per SIGTERM
    and 4 more at most)."""
    cfg, run_dir, steps = folder / f"{arm}.toml", folder / arm, args.steps
    due = schedule(steps, args.fault_every_steps or steps // 5)  # nan: by the config
    raw = config(arm, steps, args.step_ms, args.heartbeat_ms, due, args.checkpoint_every)
    cfg.write_text(tomli_w.dumps(raw))
    command = [sys.executable, "-m", "vatra", "train", str(cfg), "--run-dir", str(run_dir)]
    if arm == "restart":
        command += ["--max-restarts", "10"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    faults: list[dict[str, Any]] = []
    history: list[tuple[float, int]] = []  # (time, rank 0's step) whenever it changes
    stopped: tuple[int, float] | None = None
    began, launches, code = time.time(), 0, 1
    with (folder / f"{arm}.log").open("w") as log:
        while launches < 5 + sum(kind == "SIGTERM" for kind, _ in due):
            launches += 1
            proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            while proc.poll() is None:
                now, first = time.time(), _progress(run_dir, 0)
                if first is not None and (not history or history[-1][1] != first["step"]):
                    history.append((now, int(first["step"])))
                if stopped is not None and now >= stopped[1]:
                    os.kill(stopped[0], signal.SIGCONT)
                    stopped = None
                if first is not None and len(faults) < len(due) and first["step"] >= due[len(faults)][1] - 1:
                    kind = due[len(faults)][0]
                    second = _progress(run_dir, 1)
                    if kind != "nan" and second is None:
                        continue
                    if kind == "kill -9":
                        os.kill(int(second["pid"]), signal.SIGKILL)  # type: ignore[index]
                    elif kind == "SIGTERM":
                        os.kill(int(second["pid"]), signal.SIGTERM)  # type: ignore[index]
                    elif kind == "slow node":
                        os.kill(int(second["pid"]), signal.SIGSTOP)  # type: ignore[index]
                        stopped = (int(second["pid"]), now + STOP_S)  # type: ignore[index]
                    faults.append({"kind": kind, "time": now, "step": int(first["step"])})
                time.sleep(0.02)
            code = proc.returncode
            if code == 0:
                break
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    usual = statistics.median(m["step_time_s"] for m in metrics if "step_time_s" in m)
    # time lost per fault: from it to the next fault (or the last step), the wall time less the
    # usual time of the steps rank 0 gained (a stall, a restart's recomputed steps, a relaunch)
    ends = [(f["time"], f["step"]) for f in faults[1:]] + [history[-1]]
    for fault, (t_end, s_end) in zip(faults, ends, strict=True):
        fault["lost_s"] = round(t_end - fault["time"] - (s_end - fault["step"]) * usual, 3)
        fault["stall_s"] = stall(history, fault["time"], t_end, usual)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    ettr = ettr_of_run(run_dir)
    parts = ettr["ettr_parts"]
    return {
        "arm": arm,
        "exit_code": code,
        "launches": launches,
        "bench_wall_s": round(time.time() - began, 1),
        "ettr": ettr["ettr"],
        "ettr_after_startup": parts["productive"] / (parts["wall"] - parts["startup"]),
        "parts": parts,
        "usual_step_s": usual,
        "faults": faults,
        "quorum_stalls_s": [
            e["stall_s"] for e in events if e["event"] == "quorum_changed" and e["group"] == 0
        ],
        "heals": [e for e in events if e["event"] == "recovered"],
        "steps": max(m["step"] for m in metrics),
        "history": history,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3500, help="the run's length in optimizer steps")
    parser.add_argument(
        "--fault-every-steps", type=int, default=0, help="steps between faults (0: a fifth of the run)"
    )
    parser.add_argument("--checkpoint-every", type=int, default=100, help="checkpoint.every_steps")
    parser.add_argument("--step-ms", type=float, default=30.0, help="rank 0's sleep per step (compute)")
    parser.add_argument("--heartbeat-ms", type=int, default=2000, help="resilience.live_heartbeat_ms")
    parser.add_argument("--together", action="store_true", help="run both arms at the same time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2 if args.together else 1) as pool:
        arms = list(pool.map(lambda arm: run_arm(arm, Path(tmp), args), ("restart", "live")))
    print_table(
        [
            "recovery",
            "exit",
            "launches",
            "ETTR",
            "ETTR after start-up",
            "wall s",
            "start-up s",
            "restart s",
            "recomputed s",
            "checkpoint stall s",
            "other s",
            "usual step ms",
        ],
        [
            [
                a["arm"],
                a["exit_code"],
                a["launches"],
                round(a["ettr"], 3),
                round(a["ettr_after_startup"], 3),
                *(round(a["parts"][k], 1) for k in ("wall", "startup", "restart", "recomputed")),
                *(round(a["parts"][k], 1) for k in ("checkpoint_stall", "other")),
                round(1000 * a["usual_step_s"], 1),
            ]
            for a in arms
        ],
    )
    print()
    print_table(
        ["fault", "step", *(f"{a['arm']}: {what}" for a in arms for what in ("stall s", "time lost s"))],
        [
            [kind, step, *(a["faults"][n][k] for a in arms for k in ("stall_s", "lost_s"))]
            for n, (kind, step) in enumerate(schedule(args.steps, args.fault_every_steps or args.steps // 5))
            if all(n < len(a["faults"]) for a in arms)
        ],
    )
    live = arms[1]
    print(f"\nlive: survivors' quorum stalls (events) {live['quorum_stalls_s']}; heals {len(live['heals'])}")
    write_result("live_recovery", {"args": vars(args), "arms": arms})


if __name__ == "__main__":
    main()
