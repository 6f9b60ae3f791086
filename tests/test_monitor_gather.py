"""The monitor's window pipeline on 2 gloo ranks: every step judged once, verdicts a fixed number of
steps late (2), identical on both ranks (alarms and the streams they are blamed on included), and
every window judged before the run ends."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from tests._dist import spawn
from tests.conftest import small_config

from vatra.engine import DistContext, Plugin, Trainer
from vatra.monitor import Monitor
from vatra.resilience.chaos import TrainingFaults

STEPS, EVERY, WORLD = 23, 5, 2
SPIKE = 23  # a gradient spike at the last step: the robust z is ready (22 residuals), alarms on it


class SlowRank(Plugin):
    """Rank 1 computes slowly: the straggler view must name it through the pipeline."""

    def on_step_start(self, trainer: Trainer) -> None:
        if trainer.dist.rank == 1:
            time.sleep(0.03)


class Recorder(Plugin):
    """Placed after the monitor: what a healing policy would see at each step."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.verdicts: list[dict[str, Any]] = []

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.losses[metrics["step"]] = metrics["loss"]
        v = trainer.state.extras.get("monitor")
        if v is not None and v.step == metrics["step"]:
            self.verdicts.append(
                {
                    "step": v.step,
                    "steps": v.steps,
                    "loss": v.loss,
                    "slowest": v.slowest_rank,
                    "alarm_steps": v.alarm_steps,
                    "stream_alarms": v.stream_alarms,
                }
            )


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    cfg = small_config(
        train={"steps": STEPS, "batch_size": 8},
        monitor={"gather_every": EVERY, "detectors": ["zscore"], "report": False, "warmup_steps": 10},
        chaos={"grad_spike_at": [SPIKE]},
    )
    ctx = DistContext.init(cfg.dist, rank=rank, world_size=WORLD, init_method=f"file://{init_file}")
    try:
        recorder = Recorder()
        plugins = [TrainingFaults(cfg.chaos), Monitor(cfg), SlowRank(), recorder]
        Trainer.from_config(cfg, dist=ctx, plugins=plugins).fit()
        out = {"losses": recorder.losses, "verdicts": recorder.verdicts}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        ctx.destroy()


def test_verdicts_arrive_a_fixed_lag_after_their_window_alike_on_every_rank(tmp_path: Path) -> None:
    # Execute: 23 steps, a window every 5 steps, rank 1 slow, a gradient spike at the last step
    spawn(_worker, WORLD, (str(tmp_path / "rdzv"), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    verdicts = ranks[0]["verdicts"]
    # Assert: both ranks saw the same verdicts at the same steps, the spike's alarm and the stream
    # it is blamed on included (rank 0 judges; the others know it only from the broadcast)
    assert verdicts == ranks[1]["verdicts"]
    assert verdicts[-1]["alarm_steps"] == [SPIKE] and verdicts[-1]["stream_alarms"] == {"grad_norm": [SPIKE]}
    assert not any(v["alarm_steps"] for v in verdicts[:-1])
    # each window's verdict 2 steps after its last step; at the last step, the last window (21-23)
    assert [v["step"] for v in verdicts] == [7, 12, 17, 22, 23]
    windows = [list(range(s - 4, s + 1)) for s in (5, 10, 15, 20)] + [[21, 22, 23]]
    assert [v["steps"] for v in verdicts] == windows
    # the loss of each step is the mean over both ranks
    for v in verdicts:
        for step, loss in zip(v["steps"], v["loss"], strict=True):
            per_rank = [r["losses"][str(step)] for r in ranks]
            assert abs(loss - sum(per_rank) / WORLD) < 1e-6
    # rank 1 is the straggler in every window after the first (start-up is uneven)
    assert all(v["slowest"] == 1 for v in verdicts[1:])
