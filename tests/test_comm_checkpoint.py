"""Compression state is training state: a top-k run with error feedback and momentum correction,
resumed from a checkpoint, repeats the uninterrupted run's steps exactly (2 gloo ranks, vatra's workers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests._dist import rewind, train_ranks

from vatra.rundir import read_jsonl

SETS = [
    "train.steps=16",
    "train.eval_every=0",
    "model.hidden=[32]",
    "optim.name=sgd",
    "optim.lr=0.05",
    "optim.momentum=0.9",
    "optim.warmup_steps=0",
    "comm.method=topk",
    "comm.ratio=0.05",
    "comm.momentum_correction=true",
    "checkpoint.every_steps=4",
    "monitor.enabled=false",
    "heal.enabled=false",
    "run.tensorboard=false",
    "run.progress=off",
]


@pytest.mark.slow(19)
def test_a_resumed_compressed_run_repeats_the_uninterrupted_one(tmp_path: Path) -> None:
    # Prepare: an uninterrupted 16-step run that checkpoints every 4 steps
    run, again = tmp_path / "run", tmp_path / "again"
    train_ranks(run, *SETS)
    done = rewind(run, again, step=8)
    # Execute: train again from step 8 (a restart after a failure looks the same)
    train_ranks(again, *SETS)
    # Assert: steps 9-16 are the same, loss for loss (residuals and velocities were restored, not
    # restarted from zero, which changes the update at step 9 already)
    lines = read_jsonl(again / "metrics.jsonl")
    before = {m["step"]: m["loss"] for m in lines[:done]}
    after = {m["step"]: m["loss"] for m in lines[done:]}
    assert sorted(after) == list(range(9, 17))
    assert all(after[s] == before[s] for s in after), (before, after)
