"""A notice seen by one node's watcher stops every rank at the same step; the run resumes on fewer ranks."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tests._dist import TRAIN_2, events, start_training, start_vatra

from vatra.config import load_config
from vatra.resilience import LATEST, open_store
from vatra.resilience.recovery import read_progress
from vatra.rundir import read_jsonl


@pytest.mark.slow(40)
def test_a_notice_file_stops_both_ranks_at_one_step_and_the_run_resumes_on_one(tmp_path: Path) -> None:
    # Prepare: a long 2-rank run watching a notice file; only rank 0 (local rank 0) watches it
    run, flag = tmp_path / "run", tmp_path / "preempt"
    spot = ["--set", f"spot.notice_file='{flag}'", "--set", "spot.poll_s=0.05"]
    proc = start_training(run, "--set", "train.steps=100000", "--set", "checkpoint.every_steps=0", *spot)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and len(read_jsonl(run / "metrics.jsonl")) < 5:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    # Execute: the node's agent writes the notice file
    flag.touch()
    _, err = proc.communicate(timeout=120)
    # Assert: both ranks stopped at the step of the checkpoint, which landed within the window
    assert proc.returncode == 143, err[-2000:]
    (saved,) = events(run, "preemption_checkpoint")
    assert saved["fit"] is True and saved["source"] == "file"
    last = [read_progress(run, rank) for rank in (0, 1)]  # each rank's last completed step
    assert last[0] and last[1] and last[0]["step"] == last[1]["step"] == saved["step"]
    store = open_store(load_config(run / "config.toml").store, run / "checkpoints")
    assert store.manifest(LATEST)["step"] == saved["step"] and store.verify(LATEST) == []
    assert "preemption notice" in err and "within its 120 s window" in err
    # Execute: the notice is gone; the same run goes on with one rank (the other machine was taken)
    flag.unlink()
    until = saved["step"] + 5
    args = [*TRAIN_2, "--run-dir", str(run), "--set", f"train.steps={until}", *spot]
    args[args.index("--nproc") + 1] = "1"
    again = start_vatra("train", "examples/digits.toml", *args)
    _, err = again.communicate(timeout=180)
    # Assert: resumed from the notice's checkpoint on world size 1, nothing lost, to the end
    assert again.returncode == 0, err[-2000:]
    (resume,) = events(run, "resume")
    assert (resume["resumed_step"], resume["saved_world_size"], resume["world_size"]) == (saved["step"], 2, 1)
    assert resume["steps_lost"] == 0
    assert store.manifest(LATEST)["step"] == until
