"""A disk that fills mid-save: the previous version stays intact, the run stops with one line, and the
same command resumes once space is freed. The run folder lives on a small tmpfs (needs root)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._dist import run_vatra
from tests.conftest import small_disk

from vatra.config import load_config
from vatra.resilience import LATEST, open_store
from vatra.rundir import read_jsonl

# One digits version on 2 ranks is ~412 KiB (model + AdamW moments in two DCP files, rank files):
# 720 KiB hold the first save (step 10) and the logs, not a second one; ~200 KiB stay free.
SMALL, LARGE = "720k", "8m"
ARGS = [
    "train", "examples/digits.toml", "--nproc", "2",
    "--set", "train.steps=30", "--set", "train.eval_every=0", "--set", "checkpoint.every_steps=10",
    "--set", "checkpoint.keep_last=0", "--set", "run.tensorboard=false", "--set", "run.progress=off",
    "--set", "monitor.report=false",
]  # fmt: skip


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_disk(tmp_path / "disk", SMALL) as path:
        yield path


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == kind]


@pytest.mark.slow(54)
def test_a_full_disk_mid_save_keeps_the_last_version_stops_in_one_line_and_resumes(disk: Path) -> None:
    # Prepare
    run = disk / "run"
    # Execute: the save at step 20 cannot fit
    failed = run_vatra(*ARGS, "--run-dir", str(run))
    # Assert: exit 1 (not a usage error), one line naming the cause, the path and the way out
    assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-2000:]
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert lines[0].startswith("error: saving checkpoint s0000020-a0 (step 20) failed: no space left")
    assert str(run / "checkpoints" / ".work") in lines[0] and "resume from s0000010-a0" in lines[0]
    # the version before is intact and still the newest; no staging files are left behind
    store = open_store(load_config(run / "config.toml").store, run / "checkpoints")
    assert store.manifest(LATEST)["version"] == "s0000010-a0" and store.verify(LATEST) == []
    assert not [p for p in (run / "checkpoints" / ".work").rglob("*") if p.is_file()]
    assert not [k for k in store.backend.keys("objects/") if ".tmp" in k]
    # Execute: space is freed, the same command runs again
    subprocess.run(["mount", "-o", f"remount,size={LARGE}", str(disk)], check=True)
    resumed = run_vatra(*ARGS, "--run-dir", str(run))
    # Assert: it resumed from the last good version and finished
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (resume,) = _events(run, "resume")
    assert resume["version"] == "s0000010-a0" and resume["resumed_step"] == 10
    assert json.loads((run / "summary.json").read_text())["steps"] == 30
    assert store.manifest(LATEST)["step"] == 30 and store.verify(LATEST) == []
