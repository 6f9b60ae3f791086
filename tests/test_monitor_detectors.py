"""Detectors: each flags injected spikes and NaNs and stays quiet on clean digits runs."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sklearn.ensemble import IsolationForest
from tests.conftest import small_config

from vatra.config import MonitorConfig
from vatra.engine import Trainer
from vatra.monitor import Ensemble, JsonlWriter
from vatra.monitor.iforest import IsolationForestDetector, PackedForest
from vatra.monitor.signals import RobustZ
from vatra.resilience.chaos import TrainingFaults
from vatra.rundir import RunDir, read_jsonl

STEPS = 400
GRAD_SPIKES = [180, 260, 340]
LR_SPIKE = 300


def _stream(tmp: Path, seed: int, **chaos: object) -> list[tuple[float, float]]:
    """(loss, grad norm) per step of a real digits run (the digits example's model and optimizer)."""
    cfg = small_config(
        model={"hidden": [128, 128]},
        train={"steps": STEPS, "batch_size": 32, "clip_grad_norm": 5.0},
        optim={"name": "adamw", "lr": 0.003, "schedule": "cosine", "warmup_steps": 20},
        run={"seed": seed},
        chaos=dict(chaos),
        monitor={"enabled": False},
        heal={"enabled": False},
    )
    run_dir = RunDir(tmp / f"run-{seed}-{len(chaos)}").create()
    plugins = [TrainingFaults(cfg.chaos)] if TrainingFaults.wanted(cfg.chaos) else []
    Trainer.from_config(cfg, plugins=[*plugins, JsonlWriter(run_dir)], run_dir=run_dir).fit()
    return [(r["loss"], r["grad_norm"]) for r in read_jsonl(run_dir.metrics)]


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[float, float]]]:
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("streams")
    return {
        "clean-0": _stream(tmp, 0),
        "clean-1": _stream(tmp, 1),
        "grad_spike": _stream(tmp, 2, grad_spike_at=GRAD_SPIKES),
        "lr_spike": _stream(tmp, 3, lr_spike_at=[LR_SPIKE], lr_spike_steps=5),
    }


def _alarms(detector: str, stream: list[tuple[float, float]]) -> list[int]:
    """Steps at which an ensemble of this one detector alarms; learned fits are awaited, not raced."""
    # Fits in a thread: this test is about what the detectors flag (the helper process is tested below).
    ens = Ensemble(MonitorConfig(detectors=[detector], vote=1, fit_in="thread"))
    out = []
    for step, (loss, grad_norm) in enumerate(stream, start=1):
        if step == ens.cfg.warmup_steps + 1:
            ens.close()  # wait for the background fit so the test does not depend on thread timing
        if ens.observe(step, loss, grad_norm) is not None:
            out.append(step)
    ens.close()
    return out


@pytest.mark.parametrize("detector", ["zscore", "iforest", "autoencoder"])
def test_detector_quiet_on_clean_runs_and_flags_spikes(detector: str, streams: dict) -> None:
    for name in ("clean-0", "clean-1"):
        assert _alarms(detector, streams[name]) == [], f"{detector} alarmed on clean run {name}"
    flagged = _alarms(detector, streams["grad_spike"])
    for s in GRAD_SPIKES:
        assert s in flagged, f"{detector} missed the gradient spike at step {s}: {flagged}"
    lr = _alarms(detector, streams["lr_spike"])
    assert any(LR_SPIKE <= s <= LR_SPIKE + 5 for s in lr), f"{detector} missed the LR spike: {lr}"


@pytest.mark.parametrize("detector", ["zscore", "iforest", "autoencoder"])
def test_nan_is_always_an_alarm(detector: str, streams: dict) -> None:
    ens = Ensemble(MonitorConfig(detectors=[detector], vote=1, fit_in="thread"))
    for step, (loss, grad_norm) in enumerate(streams["clean-0"][:50], start=1):
        assert ens.observe(step, loss, grad_norm) is None  # warm-up: only non-finite values alarm
    alarm = ens.observe(51, math.nan, 1.0)
    assert alarm is not None and alarm.detectors == ["nonfinite"]
    assert ens.observe(52, 0.5, math.inf) is not None


def test_packed_forest_scores_like_scikit_learn() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 3))
    forest = IsolationForest(n_estimators=50, max_samples=128, random_state=0).fit(x)
    probe = np.vstack([rng.normal(size=(40, 3)), rng.normal(scale=4.0, size=(10, 3))])
    # Same trees, same path lengths: equal up to float summation order.
    np.testing.assert_allclose(
        PackedForest.from_sklearn(forest).score(probe), -forest.score_samples(probe), rtol=1e-12
    )


def test_robust_z_follows_a_level_shift_but_not_a_spike() -> None:
    z = RobustZ(alpha=0.05)
    rng = np.random.default_rng(0)
    for v in rng.normal(1.0, 0.1, size=200):
        z.update(float(v))
    assert z.z(100.0) > 100  # a spike is far out
    z.update(100.0)
    assert abs(z.center - 1.0) < 0.1  # ... and barely moves the baseline (winsorised update)
    for v in rng.normal(2.0, 0.1, size=300):
        z.update(float(v))
    assert abs(z.z(2.0)) < 3  # a lasting shift becomes the new normal


def test_a_window_of_z_updates_in_one_call_equals_one_call_per_value() -> None:
    rng = np.random.default_rng(0)
    values = [*rng.normal(1.0, 0.1, 150), 100.0, math.nan, math.inf, *rng.standard_cauchy(150)]
    one, many = RobustZ(alpha=0.05), RobustZ(alpha=0.05)
    expected = [one.z_then_update(float(v)) for v in values]
    got: list[float] = []
    for i in range(0, len(values), 7):  # windows that straddle the ready point and every refresh
        got += many.z_then_update_many([float(v) for v in values[i : i + 7]])
    np.testing.assert_array_equal(got, expected)  # NaN where NaN, bit for bit elsewhere
    assert (many.center, list(many.residuals)) == (one.center, list(one.residuals))


class _RecordingFitter:
    """Runs each fit at once, in this thread, and records the rows it was given."""

    def __init__(self) -> None:
        self.fitted: list[np.ndarray] = []

    def submit(self, fn: Any, *args: Any) -> Any:
        from concurrent.futures import Future

        self.fitted.append(args[-1])
        fut: Future[Any] = Future()
        fut.set_result(fn(*args))
        return fut

    def close(self, wait: bool = True) -> None:
        return None


def test_learning_a_window_in_one_call_submits_the_same_fits_as_row_by_row() -> None:
    cfg = MonitorConfig(warmup_steps=30, refit_every=45)
    rows = np.random.default_rng(1).normal(size=(200, 3))
    by_row, by_window = IsolationForestDetector(cfg, 3), IsolationForestDetector(cfg, 3)
    by_row.fitter, by_window.fitter = _RecordingFitter(), _RecordingFitter()
    for start in range(0, len(rows), 10):
        for det in (by_row, by_window):
            assert det.ready is (det.fits > 0)  # swaps a finished fit in, as the ensemble does per window
        for x in rows[start : start + 10]:
            by_row.learn(x)
        by_window.learn_many(rows[start : start + 10])
    assert len(by_row.fitter.fitted) >= 3  # the warm-up fit and refits
    assert len(by_window.fitter.fitted) == len(by_row.fitter.fitted)
    for a, b in zip(by_window.fitter.fitted, by_row.fitter.fitted, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.stack(by_window.buffer), np.stack(by_row.buffer))


def _fails(message: str) -> None:
    raise ValueError(message)


def test_fits_run_in_a_helper_process_that_reports_errors_and_exits_with_its_parent() -> None:
    from vatra.monitor._fitproc import ProcessFitter

    fitter = ProcessFitter()
    assert fitter.submit(os.getpid).result(timeout=120) != os.getpid()  # ran in another process
    with pytest.raises(RuntimeError, match="ValueError: bad rows"):
        fitter.submit(_fails, "bad rows").result(timeout=60)
    # The same detector fitted in the helper scores like one fitted here (same seed, same rows).
    rows = np.random.default_rng(0).normal(size=(200, 3))
    det = IsolationForestDetector(MonitorConfig(warmup_steps=200, fit_in="process"), 3)
    det.fitter = fitter
    for row in rows:
        det.learn(row)
    det.close()
    here = IsolationForestDetector(MonitorConfig(warmup_steps=200), 3)
    model, threshold = here._fit_and_calibrate(rows)
    assert det.ready and det.threshold() == threshold
    np.testing.assert_array_equal(det.score_many(rows[:20]), model.score(rows[:20]))
    helper = fitter.proc
    assert helper is not None
    fitter.close()  # closing its stdin ends the helper
    assert helper.poll() is not None and fitter.proc is None


PARENT = """
import os, socket, sys, time
from vatra.monitor._fitproc import ProcessFitter
listener = socket.create_server(("127.0.0.1", 0))  # stands for the parent's gloo and HTTP sockets
fitter = ProcessFitter()
helper_pid = fitter.submit(os.getpid).result(timeout=120)
print(helper_pid, type(fitter.proc).__name__, listener.getsockname()[1], flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the forked helper is Linux-only")
def test_the_forked_helper_keeps_none_of_the_parents_sockets_and_dies_with_a_killed_parent() -> None:
    import signal
    import socket
    import subprocess
    import time

    # Prepare: a training-like parent that holds a listening socket and has started its helper
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    helper_pid, kind, port = parent.stdout.readline().split()
    assert kind == "ForkedHelper"  # forked: torch and scikit-learn are not imported again
    links = [os.readlink(f"/proc/{helper_pid}/fd/{fd}") for fd in os.listdir(f"/proc/{helper_pid}/fd")]
    assert not any(link.startswith("socket:") for link in links), links
    # Execute: kill -9 the parent
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    # Assert: the helper sees its job pipe close and exits
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{helper_pid}") and time.monotonic() < deadline:
        with open(f"/proc/{helper_pid}/stat") as stat:
            if stat.read().split(")")[-1].split()[0] == "Z":  # exited; reaped by init later
                break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{helper_pid}"), "the helper outlived its parent"
    socket.create_server(("127.0.0.1", int(port))).close()  # the parent's port is free: nobody holds it


def test_closing_at_the_end_of_a_run_drops_queued_fits_instead_of_starting_a_new_helper() -> None:
    import time

    from vatra.monitor._fitproc import ProcessFitter

    # Prepare: one fit running in the helper, a second queued behind it (two detectors' first fits)
    fitter = ProcessFitter()
    started: list[int] = []
    start = fitter._start

    def counting_start() -> Any:
        proc = start()
        if proc.pid not in started:
            started.append(proc.pid)
        return proc

    fitter._start = counting_start  # type: ignore[method-assign]
    running = fitter.submit(time.sleep, 30)
    queued = fitter.submit(os.getpid)
    deadline = time.monotonic() + 60
    while not started and time.monotonic() < deadline:
        time.sleep(0.05)
    # Execute: the run is over; fits in flight are of no use
    fitter.close(wait=False)
    # Assert: the running fit died with the helper, the queued one never started another helper
    with pytest.raises(EOFError):
        running.result(timeout=60)
    with pytest.raises(RuntimeError, match="closed before this fit started"):
        queued.result(timeout=60)
    assert len(started) == 1 and fitter.proc is None
    # a later fit starts a fresh helper
    assert fitter.submit(os.getpid).result(timeout=120) != os.getpid()
    fitter.close()


def test_a_failed_fit_keeps_going_and_falls_back_to_a_thread_when_the_helper_fails() -> None:
    from vatra.monitor._fitproc import ProcessFitter, ThreadFitter

    class NoHelper(ProcessFitter):
        def _start(self) -> Any:
            raise OSError("cannot start the helper")

    det = IsolationForestDetector(MonitorConfig(warmup_steps=20, fit_in="process"), 3)
    det.fitter = NoHelper()
    rows = np.random.default_rng(0).normal(size=(60, 3))
    for row in rows[:20]:
        det.learn(row)  # the first fit is due: submitted to the broken helper
    with pytest.warns(UserWarning, match="fitting in a thread from now on"):
        det.close()
    assert not det.ready and "cannot start the helper" in (det.fit_error or "")
    for row in rows[20:39]:
        det.learn(row)
    assert det._future is None  # a retry waits for warmup_steps more clean rows
    det.learn(rows[39])
    assert isinstance(det.fitter, ThreadFitter)  # not the helper again
    det.close()
    assert det.ready and det.fits == 1
