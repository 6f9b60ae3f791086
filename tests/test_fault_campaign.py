"""The fault campaign's harness (bench/fault_campaign.py): its verdicts, its processes, one real run."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from vatra.config import load_config
from vatra.monitor.ettr import ettr_of_run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import _faults as F  # noqa: E402
import fault_campaign as fc  # noqa: E402


def test_plan_deals_every_kind_evenly_and_repeats_with_its_seed() -> None:
    cfg = load_config(ROOT / "examples" / "digits.toml")
    plan = fc.draw_plan(20, list(fc.KINDS), 7, cfg, nproc=2)
    counts = {k: sum(f.kind == k for f in plan) for k in fc.KINDS}
    assert sorted(counts.values()) == [2, 2, 2, 2, 3, 3, 3, 3]
    assert plan == fc.draw_plan(20, list(fc.KINDS), 7, cfg, nproc=2)
    assert plan != fc.draw_plan(20, list(fc.KINDS), 8, cfg, nproc=2)
    for f in plan:
        assert 0 <= f.rank < 2 and 0 <= f.node < fc.ERASURE["m"]
        # store faults need a saved version to damage; every fault fires before the run ends
        low = cfg.checkpoint.every_steps + 5 if f.kind in fc.STORE_KINDS else 5
        assert low <= f.step <= cfg.train.steps - 10


@pytest.mark.parametrize(
    ("rc", "stderr", "clear"),
    [
        (143, "vatra: note\nerror: SIGTERM at step 7: saved checkpoint s7; run the same command\n\n", True),
        (1, "Traceback (most recent call last):\n  ...\nOSError: full\nerror: worker(s) failed\n", False),
        (1, "error: one\nerror: two\n", False),
        (1, "error: fine\nW1201 a warning after it\n", False),
        (0, "error: looks like one\n", False),  # a run that finished did not stop
    ],
)
def test_a_clear_stop_is_one_error_line_last_and_no_traceback(rc: int, stderr: str, clear: bool) -> None:
    assert F.Attempt(rc=rc, wall_s=1.0, stderr=stderr).clear_stop is clear


def test_productive_time_counts_each_step_of_the_final_trajectory_once(tmp_path: Path) -> None:
    # the campaign's ETTR is vatra.monitor.ettr's: a replayed step counts once, from its last run
    metrics: list[dict[str, Any]] = [
        {"step": 1, "step_time_s": 1.0},
        {"step": 2, "step_time_s": 1.0},
        {"step": 3, "step_time_s": 9.0},  # lost to a kill: replayed below
        {"step": 2, "step_time_s": 2.0},
        {"step": 3, "step_time_s": 3.0},
        {"event": "not a step"},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    parts = ettr_of_run(tmp_path)["ettr_parts"]
    assert (parts["productive"], parts["recomputed"]) == (6.0, 10.0)


def test_a_version_is_lost_when_damaged_or_deleted_without_retention_reason() -> None:
    before = {"a": {"step": 25, "time": 1.0}, "b": {"step": 50, "time": 2.0}}
    newer = {f"n{i}": {"step": 50 + i, "time": 3.0 + i} for i in range(2)}
    assert F.lost_versions(before, {"b": before["b"], **newer}, keep_last=2) == []  # a: pruned by keep_last
    assert F.lost_versions(before, {"b": before["b"], **newer}, keep_last=4) == ["a"]  # too few newer
    assert F.lost_versions(before, newer, keep_last=0) == ["a", "b"]  # keep_last 0 keeps every version


def test_weights_compare_bit_for_bit() -> None:
    a = {"model": {"w": torch.tensor([0.0, 1.0])}, "optim": {"state": {"w": {"step": torch.tensor(3.0)}}}}
    same = {"model": {"w": torch.tensor([0.0, 1.0])}, "optim": {"state": {"w": {"step": torch.tensor(3.0)}}}}
    assert F.first_difference(a, same) is None
    assert F.first_difference(a, {**same, "model": {"w": torch.tensor([-0.0, 1.0])}}) == "model.w"
    assert F.first_difference(a, {**same, "model": {"w": torch.tensor([0.0, 1.0], dtype=torch.float64)}})
    assert F.first_difference(a, {"model": a["model"]}) is not None


def test_job_kills_workers_that_live_in_sessions_of_their_own(tmp_path: Path) -> None:
    # a launcher that starts a child in a new session (as torch's agent does) and both sleep
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
        "time.sleep(60)"
    )
    job = F.Job([sys.executable, "-c", code], tmp_path / "launch0", timeout_s=30)
    deadline = time.monotonic() + 10
    while not job.scan() and time.monotonic() < deadline:
        time.sleep(0.05)
    (child,) = job.seen
    os.killpg(job.proc.pid, signal.SIGKILL)  # the launcher's group alone misses the child
    attempt = job.finish()
    assert attempt.rc == -signal.SIGKILL and attempt.leftovers == 1
    deadline = time.monotonic() + 5
    while F._stat(child) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert F._stat(child) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root only)")
def test_fill_disk_fills_a_small_tmpfs_that_is_unmounted_after(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    with F.tmpfs(mnt, 1):
        written = F.fill_disk(mnt)
        with pytest.raises(OSError, match="No space left"):
            (mnt / "more").write_bytes(b"x" * 4096)
    assert 0.9 * 2**20 <= written <= 2**20
    mounts = Path("/proc/mounts").read_text()
    assert str(mnt) not in mounts
