"""Run-folder writers: metrics.jsonl every step, TensorBoard's per-step scalars every N steps."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import small_config

from vatra.engine import Trainer
from vatra.monitor import JsonlWriter, TensorBoardWriter
from vatra.rundir import RunDir


def test_tensorboard_every_n_steps_keeps_sparse_metrics(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = RunDir(tmp_path / "run").create()
    cfg = small_config(train={"steps": 25, "eval_every": 7})
    plugins = [TensorBoardWriter(run_dir, every=10), JsonlWriter(run_dir)]
    Trainer.from_config(cfg, plugins=plugins, run_dir=run_dir).fit()
    acc = EventAccumulator(str(run_dir.tb))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [10, 20, 25]  # every 10th and the last
    assert [e.step for e in acc.Scalars("val/val_accuracy")] == [7, 14, 21]  # sparse: when present
    lines = [json.loads(x) for x in run_dir.metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 26))  # metrics.jsonl: every step
    assert json.loads(run_dir.summary.read_text())["steps"] == 25
