"""Robust aggregation (median, trimmed mean, Krum) and update screening, against hand-computed references."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tests.conftest import small_config

from vatra.config import config_from_dict
from vatra.errors import ConfigError
from vatra.federated import FedAvg, FitRes, ParamLayout, build_strategy
from vatra.federated.robust import Krum, Median, TrimmedMean, finite_or_none, screen
from vatra.federated.wire import WireError, decode_res, encode_res

D, N, SIGMA = 2000, 20, 0.02  # update length, clients, honest spread around the common direction


def _strategy(name: str, size: int = D, **robust: object):
    cfg = small_config(federated={"strategy": name, "clients": N, "robust": robust})
    strategy = build_strategy(cfg.federated, ParamLayout(("w",), ((size,),)))
    strategy.initialize(np.zeros(size, np.float32), seed=0)
    return strategy


def _round(poisoned: int, seed: int = 0) -> tuple[list[FitRes], np.ndarray]:
    """N results whose first ``poisoned`` updates are sign-flipped ×100; and the honest clients' mean."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(0.0, 0.1, D)
    honest = (direction + rng.normal(0.0, SIGMA, (N, D))).astype(np.float32)  # (N, D)
    sent = honest.copy()
    sent[:poisoned] *= -100.0
    results = [FitRes(c, 1, 10 + c, sent[c]) for c in range(N)]
    return results, honest[poisoned:].astype(np.float64).mean(axis=0)


# Tolerances, in units of the honest spread σ·√D (0.89 here; the honest mean's norm is ~4.5):
# median and trimmed mean move by a fraction of σ per coordinate when 4 of 20 values sit at one
# end (measured 0.17–0.38); Krum returns one honest update, √(1 + 1/16)·σ·√D from the honest mean.
TOLERANCE = {"median": 0.5, "trimmed_mean": 0.5, "krum": 1.2}


@pytest.mark.parametrize("poisoned", [1, 4])
@pytest.mark.parametrize("name", ["median", "trimmed_mean", "krum"])
def test_robust_aggregators_stay_near_the_honest_mean(name: str, poisoned: int) -> None:
    # Prepare
    results, honest_mean = _round(poisoned)
    strategy = _strategy(name)
    # Execute: from zero weights, the new weights are the aggregated update.
    new = strategy.aggregate(1, results, [])
    # Assert
    assert new is not None
    error = np.linalg.norm(new - honest_mean) / (SIGMA * np.sqrt(D))
    assert error < TOLERANCE[name], f"{name} with {poisoned} poisoned: {error:.3f} σ√D from the honest mean"


@pytest.mark.parametrize("poisoned", [1, 4])
def test_fedavg_is_steered_by_poisoned_updates(poisoned: int) -> None:
    results, honest_mean = _round(poisoned)
    strategy = _strategy("fedavg")
    new = strategy.aggregate(1, results, [])
    assert new is not None
    # One client of twenty already drags the mean more than ten honest spreads away (measured 13).
    assert np.linalg.norm(new - honest_mean) / (SIGMA * np.sqrt(D)) > 10


def test_krum_selects_honest_clients_only() -> None:
    results, _ = _round(4)
    strategy = _strategy("krum", krum_m=5)
    strategy.aggregate(1, results, [])
    assert isinstance(strategy, Krum)
    assert len(strategy.selected) == 5 and min(strategy.selected) >= 4  # clients 0–3 are the poisoned ones


def _points(*values: float) -> list[FitRes]:
    return [FitRes(c, 1, 1, np.array([v], np.float32)) for c, v in enumerate(values)]


def test_krum_scores_match_a_hand_computation() -> None:
    # Points 0, 1, 2, 3, 100 on a line, f = 1: each is scored on its n − f − 2 = 2 nearest.
    # Scores: 0 → 1² + 2² = 5; 1 → 1 + 1 = 2; 2 → 1 + 1 = 2; 3 → 1 + 4 = 5; 100 → 97² + 98².
    strategy = _strategy("krum", 1, byzantine=1)
    assert isinstance(strategy, Krum)
    updates = np.array([[0.0], [1.0], [2.0], [3.0], [100.0]], np.float32)
    np.testing.assert_array_equal(strategy.scores(updates), [5.0, 2.0, 2.0, 5.0, 97.0**2 + 98.0**2])
    # Krum takes the lowest score (the first of a tie); multi-Krum with m = 2 averages 1 and 2.
    assert strategy.aggregate(1, _points(0, 1, 2, 3, 100), []) == pytest.approx([1.0])
    multi = _strategy("krum", 1, byzantine=1, krum_m=2)
    assert multi.aggregate(1, _points(0, 1, 2, 3, 100), []) == pytest.approx([1.5])


def test_median_and_trimmed_mean_match_numpy_references() -> None:
    rng = np.random.default_rng(1)
    updates = rng.normal(size=(10, 7)).astype(np.float32)
    results = [FitRes(c, 1, 1000 * c + 1, updates[c]) for c in range(10)]  # counts are ignored
    median = _strategy("median", 7)
    np.testing.assert_allclose(median.aggregate(1, results, []), np.median(updates, axis=0), rtol=1e-6)
    trimmed = _strategy("trimmed_mean", 7, trim_ratio=0.2)  # ⌊0.2 · 10⌋ = 2 values off each end
    reference = np.sort(updates, axis=0)[2:8].astype(np.float64).mean(axis=0)
    np.testing.assert_allclose(trimmed.aggregate(1, results, []), reference, rtol=1e-6)


def test_tiny_rounds_and_no_results() -> None:
    for name in ("median", "trimmed_mean", "krum"):
        strategy = _strategy(name, 1)
        assert strategy.aggregate(1, [], []) is None
        assert strategy.aggregate(1, _points(3.0), []) == pytest.approx([3.0])  # one result: itself
        assert len(strategy.aggregate(1, _points(1.0, 2.0), []) or []) == 1


def test_an_aggregate_that_overflows_float32_keeps_the_model() -> None:
    strategy = _strategy("median")
    strategy.initialize(np.full(D, 3e38, np.float32), seed=0)
    results = [FitRes(c, 1, 1, np.full(D, 3e38, np.float32)) for c in range(3)]
    assert strategy.aggregate(1, results, []) is None
    assert np.isfinite(strategy.weights).all()
    assert finite_or_none(np.array([1.0, np.inf])) is None
    assert finite_or_none(np.ones(2)) is not None


# ------------------------------------------------------------------ screening


def _huge() -> FitRes:
    return FitRes(3, 1, 10**18, np.full(D, 1e30, np.float32))


def test_screen_neutralises_a_huge_update_with_a_huge_count() -> None:
    # Prepare: 19 honest results and one 1e30 update that claims 10^18 samples.
    results, honest_mean = _round(0)
    results[3] = _huge()
    cfg = small_config(federated={"robust": {"max_update_norm": 10.0, "max_num_samples": 100}}).federated
    # Execute: clip (the default action), then plain FedAvg.
    kept, failures = screen(results, cfg.robust)
    fedavg = FedAvg(cfg, ParamLayout(("w",), ((D,),)))
    new = fedavg.aggregate(1, kept, failures)
    # Assert: the liar's update is scaled to norm 10 and its weight capped at 100 (of ~390 in all),
    # so the mean moves by at most 10 · 100/390 ≈ 2.6 from the honest clients' mean; not 1e30.
    assert not failures and len(kept) == N
    assert kept[3].num_samples == 100
    assert np.linalg.norm(kept[3].update) == pytest.approx(10.0, rel=1e-5)
    assert new is not None and np.linalg.norm(new - honest_mean) < 3.0
    assert results[3].num_samples == 10**18  # the input was not modified


def test_screen_rejects_over_the_norm_and_a_count_that_contradicts_the_declared_one() -> None:
    results, _ = _round(0)
    results[3] = _huge()
    cfg = small_config(federated={"robust": {"max_update_norm": 10.0, "norm_action": "reject"}}).federated
    kept, failures = screen(results, cfg.robust, known_samples={5: 15, 6: 999})
    # Client 3: norm 4.5e31 > 10. Client 6 declared 999 rows at join but reports 16.
    assert {f.client_id for f in failures} == {3, 6}
    reasons = {f.client_id: f.reason for f in failures}
    assert "exceeds federated.robust.max_update_norm" in reasons[3] and "declared" in reasons[6]
    assert [r.client_id for r in kept] == [c for c in range(N) if c not in (3, 6)]


def test_screen_is_a_no_op_by_default_and_the_wire_refuses_a_count_past_2_53() -> None:
    results, _ = _round(1)
    kept, failures = screen(results, small_config().federated.robust)
    assert kept == results and not failures
    # Over the wire the 10^18 count never gets as far as screening.
    with pytest.raises(WireError, match="num_samples"):
        decode_res(encode_res(_huge()))
    ok = dataclasses.replace(_huge(), num_samples=10)
    assert decode_res(encode_res(ok)).num_samples == 10


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize(("name", "cls"), [("median", Median), ("trimmed_mean", TrimmedMean), ("krum", Krum)])
def test_config_names_the_robust_strategies(name: str, cls: type) -> None:
    cfg = config_from_dict({"federated": {"strategy": name, "robust": {"trim_ratio": 0.1, "byzantine": 2}}})
    strategy = build_strategy(cfg.federated, ParamLayout(("w",), ((4,),)))
    assert strategy.name == name and type(strategy) is cls
    assert cfg.federated.robust.trim_ratio == 0.1 and cfg.federated.robust.byzantine == 2


def test_robust_config_is_validated_with_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="trim_ratio"):
        config_from_dict({"federated": {"robust": {"trim_ratio": 0.5}}})
    with pytest.raises(ConfigError, match="needs max_update_norm > 0"):
        config_from_dict({"federated": {"robust": {"norm_action": "reject"}}})
    with pytest.raises(ConfigError, match="norm_action"):
        config_from_dict({"federated": {"robust": {"norm_action": "drop"}}})
    layout = ParamLayout(("w",), ((4,),))
    secagg = config_from_dict({"federated": {"strategy": "median", "secure_aggregation": {"enabled": True}}})
    with pytest.raises(ConfigError, match="only their sum"):
        build_strategy(secagg.federated, layout)
    too_many = config_from_dict({"federated": {"strategy": "krum", "clients": 5, "robust": {"krum_m": 6}}})
    with pytest.raises(ConfigError, match=r"krum_m = 6 exceeds federated\.clients = 5"):
        build_strategy(too_many.federated, layout)
