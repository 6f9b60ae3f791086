"""ETTR: productive step time over the wall time of every launch of a run folder."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tests.conftest import small_config

import vatra
from vatra.engine import Plugin, Trainer
from vatra.launch.ledger import launch_record
from vatra.monitor.ettr import PARTS, ettr_of_run
from vatra.monitor.report import write_report
from vatra.rundir import RunDir, read_jsonl

STEPS = ["train", "steps"]


class FailAt(Plugin):
    """The user's own plugin failing at one step: the run stops, its last checkpoint stays."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Trainer, metrics: dict) -> None:
        if trainer.state.step == self.step:
            raise RuntimeError(f"user plugin broke at step {self.step}")


class Work(Plugin):
    """Steps of a real model's length (40 ms), so the lost steps outweigh the noise of a loaded machine's
    startup and saves (the tiny model's steps alone take about 1 ms)."""

    def on_step_start(self, trainer: Trainer) -> None:
        time.sleep(0.04)


def _launch(run: Path, steps: int, *plugins: Plugin) -> None:
    cfg = small_config(train={"steps": steps}, checkpoint={"every_steps": 10}, monitor={"report": False})
    with launch_record(RunDir(run).create(), started=time.time()):
        vatra.fit(cfg, run_dir=run, plugins=plugins)


@pytest.mark.slow(12)
def test_a_failed_launch_and_its_rerun_cost_the_run_its_ettr_and_the_parts_add_up(tmp_path: Path) -> None:
    # Prepare: one run to warm this process up (its first run pays for imports the others do not)
    _launch(tmp_path / "warm-up", 2)
    # Execute: a clean 20-step run; the same run failing at step 19 and launched again
    _launch(tmp_path / "clean", 20, Work())
    with pytest.raises(RuntimeError, match="broke at step 19"):
        _launch(tmp_path / "hit", 20, Work(), FailAt(19))
    _launch(tmp_path / "hit", 20, Work())
    # Assert: the rerun resumed at step 10 and redid steps 11-18 (19 failed before its line)
    clean, hit = ettr_of_run(tmp_path / "clean"), ettr_of_run(tmp_path / "hit")
    steps = [m["step"] for m in read_jsonl(tmp_path / "hit" / "metrics.jsonl")]
    assert steps == [*range(1, 19), *range(11, 21)]
    assert hit["ettr_parts"]["recomputed"] > 0 and hit["ettr_parts"]["restart"] > 0
    assert clean["ettr_parts"]["recomputed"] == clean["ettr_parts"]["restart"] == 0
    assert hit["ettr_parts"]["recomputed"] >= 8 * 0.04  # steps 11-18, each at least its 40 ms
    assert hit["ettr"] < clean["ettr"]
    for figures in (clean, hit):
        parts = figures["ettr_parts"]
        assert sum(parts[p] for p in PARTS) == pytest.approx(parts["wall"])
        assert figures["ettr"] == pytest.approx(parts["productive"] / parts["wall"])
    # the launcher's summary carries the final figures (both launches of the hit run)
    summary = json.loads((tmp_path / "hit" / "summary.json").read_text())
    assert summary["ettr"] == pytest.approx(hit["ettr"]) and summary["ettr_parts"] == hit["ettr_parts"]
    # the failure's cause: the user's plugin, named from its traceback
    (failure,) = [e for e in read_jsonl(tmp_path / "hit" / "events.jsonl") if e["event"] == "failure"]
    assert failure["cause"]["kind"] == "user_error"
    assert any("test_ettr.py" in x for x in failure["cause"]["evidence"])
    # the report tells both: the cause, and where the wall time went
    page = write_report(tmp_path / "hit").read_text()
    assert "Most likely cause: <b>user code error</b>" in page
    assert f"ETTR <b>{hit['ettr']:.3f}</b>" in page and "<th>recomputed</th>" in page


def test_ettr_of_a_folder_by_hand(tmp_path: Path) -> None:
    # Prepare: launch 1 (0..10 s) starts at 4 s, steps 1-3 (1 s each, step 3 blocked 0.5 s by a save),
    # rank dies at 8 s, restart at 9 s redoes step 3; launch 2 (20..24 s) starts at 22 s, step 4
    events = [
        {"time": 1.0, "event": "launch_start", "started": 0.0},
        {"time": 4.0, "event": "attempt_start"},
        {"time": 8.0, "event": "worker_failed"},
        {"time": 9.0, "event": "attempt_start"},
        {"time": 10.0, "event": "launch_end"},
        {"time": 20.0, "event": "launch_start"},
        {"time": 22.0, "event": "attempt_start"},
        {"time": 24.0, "event": "launch_end"},
    ]
    metrics = [
        {"step": 1, "step_time_s": 1.0},
        {"step": 2, "step_time_s": 1.0},
        {"step": 3, "step_time_s": 1.0, "checkpoint_s": 0.5},
        {"step": 3, "step_time_s": 1.0},
        {"step": 4, "step_time_s": 1.0},
    ]
    for name, rows in (("events.jsonl", events), ("metrics.jsonl", metrics)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Execute
    got = ettr_of_run(tmp_path)
    # Assert: wall 10 + 4; startup 4; restart (9 − 8) + (22 − 20); recomputed one step
    assert got["ettr_parts"] == {
        "wall": 14.0,
        "productive": 4.0,
        "startup": 4.0,
        "restart": 3.0,
        "recomputed": 1.0,
        "checkpoint_stall": 0.5,
        "other": 1.5,
    }
    assert got["ettr"] == pytest.approx(4 / 14)
