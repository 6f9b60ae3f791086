"""The always-valid sequential test (mSPRT) on simulated experiments: its false-positive rate under
peeking stays at alpha where a fixed-horizon z-test's does not, and it still finds real effects."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vatra.serve.ab import sequential_test

ALPHA = 0.05
EXPERIMENTS = 1000
PEEK_EVERY = 100


def _se(rate: float, n: int = EXPERIMENTS) -> float:
    return math.sqrt(rate * (1 - rate) / n)


def _simulate(
    metric: str, n: int, effect: float, seed: int, share: float = 0.5
) -> tuple[np.ndarray, np.ndarray]:
    """``EXPERIMENTS`` streams of ``n`` outcomes, ``share`` of them the challenger's at random:
    (values, is challenger)."""
    rng = np.random.default_rng(seed)
    is_b = rng.random((EXPERIMENTS, n)) < share
    if metric == "binary":  # a 10 % conversion rate, the challenger's raised by ``effect``
        values = (rng.random((EXPERIMENTS, n)) < np.where(is_b, 0.10 + effect, 0.10)).astype(np.float64)
    else:  # skewed revenue-like values (lognormal), shifted by ``effect`` for the challenger
        values = rng.lognormal(0.0, 1.0, (EXPERIMENTS, n)) + np.where(is_b, effect, 0.0)
    return values, is_b


@pytest.mark.parametrize("metric", ["binary", "continuous"])
def test_aa_false_positives_stay_below_alpha_under_peeking_where_a_z_test_inflates(metric: str) -> None:
    # Prepare: 1,000 A/A experiments of 1,000 outcomes, looked at after every 100 (the p-value at
    # a peek is the minimum over every outcome so far: this is continuous monitoring)
    values, is_b = _simulate(metric, 1000, 0.0, seed=1 if metric == "binary" else 2)
    peeks = np.arange(PEEK_EVERY, 1001, PEEK_EVERY)
    # Execute
    s = sequential_test(values, is_b, metric=metric, alpha=ALPHA, horizon=1000, at=peeks)  # type: ignore[arg-type]
    seq_fp = float((s.p < ALPHA).any(axis=-1).mean())
    z_fp_10 = float((s.z_p < ALPHA).any(axis=-1).mean())
    z_fp_5 = float((s.z_p[:, :5] < ALPHA).any(axis=-1).mean())
    z_fp_once = float((s.z_p[:, -1] < ALPHA).mean())
    # Assert: the sequential test holds alpha with Monte-Carlo slack (2 standard errors)...
    assert seq_fp <= ALPHA + 2 * _se(ALPHA), seq_fp
    # ...the interval covers the true difference (0) at every peek as often
    assert float(((s.lo > 0) | (s.hi < 0)).any(axis=-1).mean()) <= ALPHA + 2 * _se(ALPHA)
    # ...a z-test looked at once is fine, but peeked at 5 and 10 times it is not (about 14 % and 19 %)
    assert abs(z_fp_once - ALPHA) <= 3 * _se(ALPHA), z_fp_once
    assert z_fp_5 > ALPHA + 5 * _se(ALPHA), z_fp_5
    assert z_fp_10 > z_fp_5 and z_fp_10 > 0.13, z_fp_10


@pytest.mark.parametrize("metric", ["binary", "continuous"])
def test_aa_false_positives_stay_below_alpha_with_a_90_10_split(metric: str) -> None:
    # Prepare: the split a canary uses (challenger 10 %); skewed values, 3,000 outcomes
    values, is_b = _simulate(metric, 3000, 0.0, seed=5 if metric == "binary" else 6, share=0.1)
    # Execute
    s = sequential_test(values, is_b, metric=metric, alpha=ALPHA, horizon=1000, at=[3000])  # type: ignore[arg-type]
    # Assert: the small arm's skew and few conversions do not break the guarantee
    assert float((s.p < ALPHA).mean()) <= ALPHA + 2 * _se(ALPHA)


def test_power_against_a_fixed_horizon_test_at_the_same_sample_size() -> None:
    # Prepare: a real lift from 10 % to 13 % conversion; 4,000 outcomes give a z-test ~90 % power
    values, is_b = _simulate("binary", 4000, 0.03, seed=3)
    peeks = np.arange(PEEK_EVERY, 4001, PEEK_EVERY)
    # Execute
    s = sequential_test(values, is_b, metric="binary", alpha=ALPHA, horizon=4000, at=peeks)
    seq_power = float(((s.p < ALPHA) & (s.effect > 0)).any(axis=-1).mean())
    z_power = float(((s.z_p[:, -1] < ALPHA) & (s.effect[:, -1] > 0)).mean())
    stopped = np.where((s.p < ALPHA).any(axis=-1), peeks[np.argmax(s.p < ALPHA, axis=-1)], 4000)
    print(f"power: sequential {seq_power:.3f}, fixed-horizon z {z_power:.3f}; mean n {stopped.mean():.0f}")
    # Assert: the price of peeking safely is some power, not most of it; and a win stops early
    assert z_power > 0.8, z_power
    assert seq_power > 0.5, seq_power
    assert seq_power < z_power + 3 * _se(z_power)
    assert stopped.mean() < 4000 * 0.8


def test_no_decision_before_min_n_and_bad_arguments_are_refused() -> None:
    # Prepare: a glaring difference but only 10 outcomes per arm
    values = np.r_[np.zeros(10), np.ones(10)]
    is_b = np.r_[np.zeros(10, bool), np.ones(10, bool)]
    # Execute
    s = sequential_test(values, is_b, metric="binary", min_n=30)
    # Assert
    assert (s.p == 1.0).all() and np.isinf(s.hi).all()
    with pytest.raises(ValueError, match="alpha"):
        sequential_test(values, is_b, alpha=1.5)
    with pytest.raises(ValueError, match="report points"):
        sequential_test(values, is_b, at=[0])


def test_the_interval_is_the_inverse_of_the_p_value() -> None:
    # Prepare: one stream with an effect
    rng = np.random.default_rng(4)
    is_b = rng.random(3000) < 0.5
    values = rng.normal(0.0, 1.0, 3000) + 0.2 * is_b
    # Execute
    s = sequential_test(values, is_b, metric="continuous", horizon=3000)
    # Assert: wherever the running p-value first drops below alpha, the interval excludes 0 then
    assert (s.p < ALPHA).any()
    first = int(np.argmax(s.p < ALPHA))
    assert s.p[first] < ALPHA and (s.lo[first] > 0 or s.hi[first] < 0)
    assert (~((s.lo[:first] > 0) | (s.hi[:first] < 0))).all()


def test_the_interval_matches_growthbooks_closed_form() -> None:
    # Prepare: GrowthBook's sequential interval (gbstats, after Howard et al.'s normal mixture) for
    # a per-outcome variance s2, N outcomes and tuning N*: rho2 = (-2 log a + log(1 - 2 log a)) / N*
    from vatra.serve.ab.sequential import mixing_variance, msprt

    s2, n_star = 2.5, 4000.0
    n = np.array([200.0, 1000.0, 4000.0, 20000.0])
    rho2 = (-2 * np.log(ALPHA) + np.log(1 - 2 * np.log(ALPHA))) / n_star
    reference = np.sqrt(s2 * 2 * (n * rho2 + 1) / (n**2 * rho2) * np.log(np.sqrt(n * rho2 + 1) / ALPHA))
    # Execute: the same through vatra's variance of the estimate V = s2 / N
    var = s2 / n
    tau2 = mixing_variance(var, n, alpha=ALPHA, horizon=int(n_star))
    _, half = msprt(np.zeros_like(n), var, tau2, ALPHA)
    # Assert: equal to float rounding, and wider than the z interval at every n (the price of peeking)
    np.testing.assert_allclose(half, reference, rtol=1e-12)
    ratio = half / (1.96 * np.sqrt(var))
    assert ratio.min() > 1.0
