"""Compression state is training state: a top-k run with error feedback and momentum correction,
resumed from a checkpoint, repeats the uninterrupted run's steps exactly (2 gloo ranks, the CLI)."""

from __future__ import annotations

from pathlib import Path

from tests._dist import run_vatra

from vatra.config import load_config
from vatra.resilience import LATEST, open_store
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
]


def test_a_resumed_compressed_run_repeats_the_uninterrupted_one(tmp_path: Path) -> None:
    # Prepare: an uninterrupted 16-step run that checkpoints every 4 steps
    run = tmp_path / "run"
    args = ["train", "examples/digits.toml", "--nproc", "2", "--run-dir", str(run)]
    for item in SETS:
        args += ["--set", item]
    first = run_vatra(*args)
    assert first.returncode == 0, first.stderr[-2000:]
    store = open_store(load_config(run / "config.toml").store, run / "checkpoints")
    store.set_tag(LATEST, next(m["version"] for m in store.versions() if m["step"] == 8))
    # Execute: train again from step 8 (a restart after a failure looks the same)
    again = run_vatra(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    # Assert: steps 9-16 are the same, loss for loss (residuals and velocities were restored, not
    # restarted from zero, which changes the update at step 9 already)
    lines = read_jsonl(run / "metrics.jsonl")
    before = {m["step"]: m["loss"] for m in lines if m["attempt"] == 0}
    after = {m["step"]: m["loss"] for m in lines if m["attempt"] == 1}
    assert sorted(after) == list(range(9, 17))
    assert all(after[s] == before[s] for s in after), (before, after)
