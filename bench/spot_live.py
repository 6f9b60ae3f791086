"""A live run under spot preemptions: the adaptive checkpoint interval against a fixed one.

One job (the digits example's data, an MLP of two 256-unit layers, ``--steps`` optimizer steps) is
trained to the end through preemptions that come at the same times for every policy: exponential
gaps of mean ``--mtbf`` seconds (seeded; default: the uninterrupted job's wall time ÷
``--per-job``, so that a job meets about that many whatever the machine's speed and load), on the
job's wall clock, restarts included. Each
preemption is either

- announced: the file ``spot.notice_file`` appears (a thread touches it); the run's watcher sees it,
  every rank saves at the next step boundary within ``spot.notice_s`` and the run exits (Preempted);
- or not: the machine is simply gone (an exception at the next step end, no save), as when a notice
  is missed.

Then the same job is started again in the same run folder and resumes from its newest checkpoint,
as the elastic launcher or a managed-jobs controller would. Policies side by side: no preemption
and no periodic saves (the baseline), ``every_steps = 25`` (the default a user keeps), and
``every_steps = "auto"`` (Young/Daly with ``spot.mtbf_s = --mtbf``), each with and without notices.

    .venv/bin/python bench/spot_live.py [--steps 800] [--per-job 4 | --mtbf S] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from _common import print_table, write_result
from vatra.config import Config, config_from_dict
from vatra.engine import Plugin, Trainer
from vatra.monitor import JsonlWriter
from vatra.resilience import CheckpointPlugin, Preempted
from vatra.rundir import RunDir, read_jsonl

MAX_PREEMPTIONS = 12  # then the job runs to its end: every policy finishes


class MachineLost(RuntimeError):
    """An unannounced preemption: the process ends without a save."""


class Preemptions(Plugin):
    """The job's preemption timeline on its wall clock: announced ones touch the notice file;
    unannounced ones end the attempt at the first step end past their time."""

    def __init__(self, times: list[float], t0: float, flag: Path | None) -> None:
        self.times, self.t0, self.flag = times, t0, flag
        self.timer: threading.Timer | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        if self.flag is not None and self.times:
            self.timer = threading.Timer(
                max(0.0, self.t0 + self.times[0] - time.monotonic()), self.flag.touch
            )
            self.timer.start()

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        if self.flag is None and self.times and time.monotonic() - self.t0 >= self.times[0]:
            self.times.pop(0)
            raise MachineLost("spot machine reclaimed without notice")

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self.stop()

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self.stop()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def config(steps: int, every: int | str, mtbf: float, flag: Path | None) -> Config:
    spot: dict[str, Any] = {"mtbf_s": mtbf, "poll_s": 0.05, "notice_s": 30.0}
    if flag is not None:
        spot["notice_file"] = str(flag)
    return config_from_dict(
        {
            "run": {"progress": "off", "tensorboard": False},
            "data": {"name": "digits"},
            "model": {"name": "mlp", "hidden": [256, 256]},
            "train": {"steps": steps, "batch_size": 64, "eval_every": 0},
            "optim": {"name": "adamw", "lr": 0.001},
            "monitor": {"enabled": False},
            "checkpoint": {"every_steps": every, "keep_last": 2},
            "spot": spot,
        }
    )


def job(run: Path, cfg: Config, times: list[float], announced: bool) -> dict[str, Any]:
    """Train to the end through the timeline; the figures of the whole job."""
    flag = Path(cfg.spot.notice_file) if announced else None
    t0, cpu0 = time.monotonic(), time.process_time()
    attempts, summary, save_s = 0, None, 0.0
    while summary is None:
        attempts += 1
        if flag is not None:
            flag.unlink(missing_ok=True)
        rd = RunDir(run).create()
        timeline = Preemptions(times, t0, flag)
        saver = CheckpointPlugin(cfg, rd)
        trainer = Trainer.from_config(cfg, plugins=[saver, timeline, JsonlWriter(rd)], run_dir=rd)
        try:
            summary = trainer.fit()
        except Preempted:
            times.pop(0)
        except MachineLost:
            pass
        save_s += sum(saver.costs)  # seconds the loop was blocked by saves, notice saves included
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    events = read_jsonl(run / "events.jsonl")
    metrics = read_jsonl(run / "metrics.jsonl")
    notices = [e for e in events if e["event"] == "preemption_checkpoint"]
    saves = [e for e in events if e["event"] == "checkpoint_saved"]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "attempts": attempts,
        "steps_trained": len(metrics),  # redone steps included
        "steps_lost": int(summary.get("steps_lost", 0)),
        "saves": len(saves),
        "train_s": sum(m["step_time_s"] for m in metrics),
        "save_s": save_s,
        "notice_saves": len(notices),
        "notice_saves_in_window": sum(1 for e in notices if e["fit"]),
        "notice_save_s_max": max((e["seconds"] for e in notices), default=0.0),
        "interval_s": summary.get("checkpoint_interval_s"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--mtbf", type=float, default=0.0, help="mean seconds between preemptions")
    ap.add_argument("--per-job", type=float, default=4.0, help="expected preemptions per job (no --mtbf)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    policies: list[tuple[str, int | str, bool]] = [  # (name, every_steps, announced)
        ("every 25 steps, notices", 25, True),
        ('"auto" (Young/Daly), notices', "auto", True),
        ("every 25 steps, no notice", 25, False),
        ('"auto" (Young/Daly), no notice', "auto", False),
    ]
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        # warm-up, not timed: the first job in a process pays lazy imports and first-use costs
        job(Path(tmp) / "warm", config(50, 10, 1.0, Path(tmp) / "warm-notice"), [], False)
        run, flag = Path(tmp) / "base", Path(tmp) / "base-notice"
        base = job(run, config(args.steps, 0, 1.0, flag), [], False)
        results.append({"policy": "uninterrupted, final save only", **base})
        mtbf = args.mtbf or base["wall_s"] / args.per_job
        rng = random.Random(args.seed)
        gaps = [rng.expovariate(1.0 / mtbf) for _ in range(MAX_PREEMPTIONS)]
        timeline = [sum(gaps[: i + 1]) for i in range(len(gaps))]
        for i, (name, every, announced) in enumerate(policies):
            cfg = config(args.steps, every, mtbf, Path(tmp) / f"notice{i}")
            figures = job(Path(tmp) / f"run{i}", cfg, list(timeline), announced)
            results.append({"policy": name, **figures})
    base_cpu = results[0]["cpu_s"]
    for r in results:
        # effective training time: the uninterrupted job's CPU seconds over this job's, restarts,
        # saves and redone steps included (CPU seconds, not wall: the shared machine's load varies
        # between jobs far more than a job's own work does)
        r["effective"] = base_cpu / r["cpu_s"]
        r["save_overhead"] = r["save_s"] / r["train_s"]
        rows.append(
            [
                r["policy"],
                r["wall_s"],
                r["cpu_s"],
                r["effective"],
                r["attempts"] - 1,
                r["steps_lost"],
                r["saves"],
                r["interval_s"] if r["interval_s"] is not None else "-",
                r["save_overhead"],
                f"{r['notice_saves_in_window']}/{r['notice_saves']}" if r["notice_saves"] else "-",
            ]
        )
    at = ", ".join(f"{t:.1f}" for t in timeline)
    print(f"{args.steps} steps; preemptions at {at} s on the job's clock (mean gap {mtbf:.2f} s)")
    print_table(
        [
            "policy",
            "wall s",
            "CPU s",
            "effective (uninterrupted CPU s / CPU s)",
            "preemptions",
            "steps lost",
            "saves",
            "interval s",
            "save overhead (save s / step s)",
            "notice saves in window",
        ],
        rows,
    )
    write_result(
        "spot_live", {"args": vars(args), "mtbf_s": mtbf, "timeline_s": timeline, "policies": results}
    )


if __name__ == "__main__":
    main()
