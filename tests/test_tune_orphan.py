"""A worker killed between ``study.ask()`` and recording who runs the trial leaves a RUNNING trial that
names no worker: the other workers fail and retry it after a grace period, so the study finishes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tests._tune_helpers import SPACE, study_of, write_config

optuna = pytest.importorskip("optuna")


def test_a_running_trial_without_a_worker_is_retried_and_the_study_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vatra.tune import study as study_module
    from vatra.tune.workers import serve

    # Prepare: a worker asked for trial 0 and was killed -9 before it wrote its "worker" attribute
    # (a grace of 1 s instead of the default, to keep the test short)
    monkeypatch.setattr(study_module, "ORPHAN_GRACE_S", 1.0)
    path = write_config(tmp_path, {"trials": 2, "space": {"optim.lr": SPACE["optim.lr"]}})
    cfg, run, study = study_of(path)
    orphan = study.ask()
    assert "worker" not in study.trials[0].user_attrs

    # Execute: one worker serves the study; before the fix it polled until the deadline
    start = time.monotonic()
    serve(cfg, url=run.url, name=run.name, deadline=time.time() + 45)
    took = time.monotonic() - start

    # Assert: the orphan failed as interrupted (no error of its own), was retried, and 2 trials finished
    trials = study.get_trials()
    assert trials[orphan.number].state.name == "FAIL" and "error" not in trials[orphan.number].user_attrs
    assert any(t.user_attrs.get("retry_of") == orphan.number for t in trials)
    assert sum(t.state.name == "COMPLETE" for t in trials) == 2
    assert took < 40, f"the study took {took:.0f} s: it waited for the deadline"


def test_a_fresh_running_trial_without_a_worker_is_left_alone(tmp_path: Path) -> None:
    from vatra.tune.study import fail_stale

    # Prepare: a trial just asked for, by a worker that is about to name itself
    path = write_config(tmp_path, {"trials": 2})
    _, _, study = study_of(path)
    trial = study.ask()

    # Execute
    failed = fail_stale(study)

    # Assert: within the grace period it is not another worker's to fail
    assert failed == [] and study.trials[trial.number].state.name == "RUNNING"
