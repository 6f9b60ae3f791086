"""The monitor's window pipeline on 2 gloo ranks: every step judged once, verdicts a fixed number of
steps late (2, or 4 with the ensemble in its helper process), identical on both ranks, and every
window judged before the run ends."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from tests.conftest import small_config

from vatra.engine import DistContext, Plugin, Trainer
from vatra.monitor import Monitor

STEPS, EVERY, WORLD = 23, 5, 2


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
                {"step": v.step, "steps": v.steps, "loss": v.loss, "slowest": v.slowest_rank}
            )


def _worker(rank: int, init_file: str, out_dir: str, judge_in: str) -> None:
    torch.set_num_threads(1)
    cfg = small_config(
        train={"steps": STEPS, "batch_size": 8},
        monitor={"gather_every": EVERY, "detectors": ["zscore"], "report": False, "judge_in": judge_in},
    )
    ctx = DistContext.init(cfg.dist, rank=rank, world_size=WORLD, init_method=f"file://{init_file}")
    try:
        recorder = Recorder()
        Trainer.from_config(cfg, dist=ctx, plugins=[Monitor(cfg), SlowRank(), recorder]).fit()
        out = {"losses": recorder.losses, "verdicts": recorder.verdicts}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        ctx.destroy()


@pytest.mark.parametrize(
    ("judge_in", "delivered"),
    [("inline", [7, 12, 17, 22, 23]), ("process", [9, 14, 19, 23])],  # answers read 2 steps later
)
def test_verdicts_arrive_a_fixed_lag_after_their_window_alike_on_every_rank(
    tmp_path: Path, judge_in: str, delivered: list[int]
) -> None:
    # Execute: 23 steps, a window every 5 steps, rank 1 slow
    mp.start_processes(
        _worker,
        args=(str(tmp_path / "rdzv"), str(tmp_path), judge_in),
        nprocs=WORLD,
        start_method="spawn",
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    verdicts = ranks[0]["verdicts"]
    # Assert: both ranks saw the same verdicts at the same steps
    assert verdicts == ranks[1]["verdicts"]
    # each window's verdict a fixed number of steps after its last step; at the last step, every
    # window still in flight (and the last one, 21-23) in one verdict
    assert [v["step"] for v in verdicts] == delivered
    windows = [list(range(s - 4, s + 1)) for s in (5, 10, 15, 20)] + [[21, 22, 23]]
    expected = windows if judge_in == "inline" else [*windows[:3], windows[3] + windows[4]]
    assert [v["steps"] for v in verdicts] == expected
    # the loss of each step is the mean over both ranks
    for v in verdicts:
        for step, loss in zip(v["steps"], v["loss"], strict=True):
            per_rank = [r["losses"][str(step)] for r in ranks]
            assert abs(loss - sum(per_rank) / WORLD) < 1e-6
    # rank 1 is the straggler in every window after the first (start-up is uneven)
    assert all(v["slowest"] == 1 for v in verdicts[1:])
