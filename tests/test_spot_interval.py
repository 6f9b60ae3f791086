"""checkpoint.every_steps = "auto": Young/Daly's interval on the run's own figures and the spot MTBF."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from tests.conftest import small_config

from vatra.config import load_config
from vatra.engine import Trainer
from vatra.errors import ConfigError
from vatra.monitor import JsonlWriter
from vatra.resilience import CheckpointPlugin
from vatra.resilience.checkpoint.schedule import (
    StepClock,
    interval_report,
    mean_cost,
    observed_mtbf,
    young_daly_s,
    young_daly_steps,
)
from vatra.rundir import RunDir, read_jsonl


@pytest.fixture(autouse=True)
def _one_thread():
    # The tests share 2 cores with other work; intra-op threads only add contention at this size.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("costs", "step_s", "mtbf_s"),
    [([0.02], 0.01, 0.5), ([2.0, 4.0, 6.0, 9.0], 0.25, 3600.0), ([30.0], 1.5, 7200.0)],
)
def test_the_interval_is_the_closed_form(costs: list[float], step_s: float, mtbf_s: float) -> None:
    # C is the moving average of the last three saves
    cost = sum(costs[-3:]) / len(costs[-3:])
    assert mean_cost(costs) == pytest.approx(cost)
    assert young_daly_s(cost, mtbf_s) == pytest.approx(math.sqrt(2 * cost * mtbf_s))
    steps = young_daly_steps(costs, step_s, mtbf_s)
    assert steps == max(1, round(math.sqrt(2 * cost * mtbf_s) / step_s))
    # what it costs: saving C every T seconds, and half an interval lost per failure
    report = interval_report(steps, step_s, cost, mtbf_s)
    interval = steps * step_s
    assert report["interval_s"] == pytest.approx(interval)
    assert report["overhead"] == pytest.approx(cost / interval)
    assert report["expected_lost_s"] == pytest.approx(interval / 2)
    assert report["expected_waste"] == pytest.approx(cost / interval + interval / (2 * mtbf_s))


def test_young_daly_minimises_the_expected_waste() -> None:
    cost, mtbf, step = 5.0, 3600.0, 0.1
    best = young_daly_steps([cost], step, mtbf)
    waste = [interval_report(n, step, cost, mtbf)["expected_waste"] for n in range(1, 20 * best, 7)]
    assert interval_report(best, step, cost, mtbf)["expected_waste"] <= min(waste) + 1e-9


def test_the_step_clock_follows_recent_steps() -> None:
    clock = StepClock(weight=0.5)
    for t in (1.0, 1.0, float("nan"), -1.0, 3.0):  # nonsense figures are skipped
        clock.observe(t)
    assert clock.step_s == pytest.approx(2.0)


def test_observed_mtbf_counts_resumes_after_preemptions(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run").create()
    assert observed_mtbf(rd, 900.0) == 900.0  # no events: the prior
    rd.log_event("attempt_start", rank=0)
    assert observed_mtbf(rd, 900.0) == 900.0  # no failure seen yet
    for _ in range(2):
        rd.log_event("resumed", rank=0, steps_lost=0)
    first = read_jsonl(rd.events)[0]["time"]
    assert observed_mtbf(rd, 900.0) == pytest.approx((time.time() - first) / 2, abs=0.5)


def test_spot_mtbf_replaces_the_checkpoint_prior(tmp_path: Path) -> None:
    # Prepare: spot.mtbf_s given; checkpoint.mtbf_s left at its default (an hour)
    cfg = small_config(train={"steps": 20}, checkpoint={"every_steps": "auto"}, spot={"mtbf_s": 0.001})
    rd = RunDir(tmp_path / "run").create()
    # Execute
    Trainer.from_config(cfg, plugins=[CheckpointPlugin(cfg, rd), JsonlWriter(rd)], run_dir=rd).fit()
    # Assert: the interval was computed from the spot MTBF (an hour would give no second save)
    computed = [e for e in read_jsonl(rd.events) if e["event"] == "checkpoint_interval"]
    assert computed and all(e["mtbf_s"] == 0.001 for e in computed)
    saves = [e["step"] for e in read_jsonl(rd.events) if e["event"] == "checkpoint_saved"]
    assert saves[:2] == [10, min(20, 10 + computed[0]["interval_steps"])]  # 20: the final save


def test_a_federated_run_refuses_spot_keys() -> None:
    with pytest.raises(ConfigError, match=r"spot\.notice_file: a federated run reads no \[spot\] keys"):
        load_config(None, ["spot.notice_file='/tmp/x'"], run="federated")
