"""The ensemble in its helper process: the same verdicts as inline, and inline again if the helper dies."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

from vatra.config._monitor import MonitorConfig
from vatra.monitor._judge import HelperJudge, InlineJudge, build_judge

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the judge helper is a fork (Linux)")

CFG = MonitorConfig(detectors=["zscore"], warmup_steps=20)


def _windows(n: int = 30, k: int = 10) -> list[tuple[list[int], list[float], list[float]]]:
    """Clean steps with a loss spike at step 150, a NaN at 200 and a gradient spike at 250."""
    rng = np.random.default_rng(0)
    loss = 1.0 + 0.05 * rng.standard_normal(n * k)
    grad = 2.0 + 0.1 * rng.standard_normal(n * k)
    loss[149], loss[199], grad[249] = 50.0, math.nan, 400.0
    cut = [slice(i * k, i * k + k) for i in range(n)]
    return [(list(range(c.start + 1, c.stop + 1)), loss[c].tolist(), grad[c].tolist()) for c in cut]


def _alarms(judge: InlineJudge | HelperJudge) -> list[tuple[int, list[str], dict[str, float]]]:
    out = []
    for window in _windows():
        judge.submit(*window)
        out += [(a.step, a.detectors, a.scores) for a in judge.collect() if a is not None]
    return out


def test_the_helper_judges_exactly_like_the_inline_ensemble() -> None:
    # Prepare
    helper = build_judge(CFG, seed=0)
    assert isinstance(helper, HelperJudge) and helper.proc is not None
    assert helper.proc.pid != os.getpid()  # judged in another process
    inline = InlineJudge(CFG, seed=0)
    # Execute
    got, expected = _alarms(helper), _alarms(inline)
    helper.close()
    inline.close()
    # Assert: the same alarms, scores bit for bit; the three faults among them
    assert got == expected
    assert {150, 200, 250} <= {step for step, _, _ in got}
    assert helper.proc is None  # stopped


def test_a_dead_helper_is_replaced_by_inline_judging_with_a_warning() -> None:
    # Prepare: two windows answered by the helper, one submitted when it dies
    judge = HelperJudge(CFG, seed=0)
    windows = _windows()
    for w in windows[:2]:
        judge.submit(*w)
        judge.collect()
    judge.submit(*windows[2])
    assert judge.proc is not None
    judge.proc.kill()
    judge.proc.wait()
    # Execute: the next answer is missing
    with pytest.warns(UserWarning, match="judge helper process failed"):
        first = judge.collect()
    for w in windows[3:]:
        judge.submit(*w)
        assert len(judge.collect()) == len(w[0])
    # Assert: the unanswered window was judged inline, and every later one too
    assert len(first) == len(windows[2][0]) and judge.inline is not None and judge.proc is None
    judge.close()
