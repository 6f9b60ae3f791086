"""Numbers a client reports are range-checked before the server computes with them.

Each test plays one lying client inside a real simulation (the lie passes the wire's checks: its
bytes are encoded and decoded as a worker's are): the liar is dropped for the round with an
``update_rejected`` event naming the reason, the run finishes, and the selector's scores, the
cluster assignments and the clip norm never hold the lie.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.conftest import small_config

from vatra.config import Config
from vatra.federated._base import EvalRes, FitIns, FitRes
from vatra.federated.checkpoint import server_state
from vatra.federated.client import LocalClient
from vatra.federated.private import PrivateUpload
from vatra.federated.simulation import simulate
from vatra.federated.wire import decode
from vatra.rundir import RunDir, read_jsonl

LIAR = 1


def _cfg(**federated: Any) -> Config:
    base = {"clients": 4, "rounds": 2, "local_steps": 2, "workers": 1, "selection": "all"}
    return small_config(
        federated={**base, **federated}, train={"steps": 2, "batch_size": 8}, monitor={"report": False}
    )


def _lie_in_fit(monkeypatch: pytest.MonkeyPatch, tamper: Callable[[FitRes], None]) -> None:
    """Client ``LIAR`` trains honestly, then changes what it sends (after its upload hook)."""
    fit = LocalClient.fit

    def lying(self: LocalClient, ins: FitIns, personal: np.ndarray | None = None) -> Any:
        res, head = fit(self, ins, personal)
        if ins.client_id == LIAR:
            res.update = np.array(res.update, dtype=np.float32)  # writable
            tamper(res)
        return res, head

    monkeypatch.setattr(LocalClient, "fit", lying)
    monkeypatch.setattr(LocalClient, "fit_group", lambda self, group: None)  # each client by itself


def _lie_in_eval(monkeypatch: pytest.MonkeyPatch, tamper: Callable[[EvalRes], None]) -> None:
    evaluate = LocalClient.evaluate

    def lying(self: LocalClient, ins: FitIns, personal: np.ndarray | None = None) -> EvalRes:
        rep = evaluate(self, ins, personal)
        if ins.client_id == LIAR:
            tamper(rep)
        return rep

    monkeypatch.setattr(LocalClient, "evaluate", lying)


def _rejections(run: RunDir) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run.events) if e.get("event") == "update_rejected"]


def _checkpoint(run: RunDir) -> dict[str, Any]:
    meta, _ = decode(server_state(run))
    return meta


def _selector_array(run: RunDir, name: str) -> np.ndarray:
    """One of the adaptive selector's per-client arrays, as the server checkpointed it."""
    return decode(server_state(run))[1][f"selector.{name}"]


def test_adaptive_selection_drops_a_negative_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the liar says its loss before training was −1e10 (it crashed select() before)
    _lie_in_fit(monkeypatch, lambda res: res.metrics.update(loss_before=-1e10))
    cfg = _cfg(selection="adaptive", clients_per_round=3, rounds=3, exploration=0.0)
    run = RunDir(tmp_path / "run")
    # Execute
    summary = simulate(cfg, run, progress=False)
    # Assert: every round ran; the liar was dropped each time it was picked, with the reason
    assert summary["rounds"] == 3
    rejected = _rejections(run)
    assert rejected and {e["client"] for e in rejected} == {LIAR}
    assert all("loss_before" in e["reason"] for e in rejected)
    stat = _selector_array(run, "stat")
    assert (np.isnan(stat) | (stat >= 0)).all()  # no score holds the lie


def test_adaptive_selection_drops_a_negative_duration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A negative duration would drag the 40th percentile below zero: no client counted as slow.
    _lie_in_fit(monkeypatch, lambda res: res.metrics.update(duration_s=-1e30))
    run = RunDir(tmp_path / "run")
    simulate(_cfg(selection="adaptive"), run, progress=False)
    assert any("duration_s" in e["reason"] for e in _rejections(run))
    durations = _selector_array(run, "duration")
    assert (np.isnan(durations) | (durations >= 0)).all()


def test_a_result_naming_another_client_is_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The adaptive selector indexes its tables by client id: an id out of range raised IndexError.
    _lie_in_fit(monkeypatch, lambda res: setattr(res, "client_id", 10**6))
    run = RunDir(tmp_path / "run")
    summary = simulate(_cfg(selection="adaptive"), run, progress=False)
    assert summary["rounds"] == 2
    # the simulation knows which client it asked: the liar fails its round under its own id
    failed = [e for e in read_jsonl(run.events) if e.get("event") == "client_failed"]
    assert any(e["client"] == LIAR and "names client 1000000" in e["reason"] for e in failed)


@pytest.mark.parametrize(
    "lie",
    [
        pytest.param(lambda res: res.metrics.pop("model"), id="no-model"),
        pytest.param(lambda res: res.metrics.update(model=-1), id="model-minus-one"),
        pytest.param(lambda res: res.metrics.update(model=7), id="model-past-k"),
        pytest.param(lambda res: res.metrics.pop("loss_after"), id="no-loss-after"),
        pytest.param(lambda res: res.metrics.update(loss_after=-0.99), id="negative-loss-after"),
    ],
)
def test_clustered_drops_a_bad_cluster_choice_or_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lie: Callable[[FitRes], None]
) -> None:
    # Prepare
    _lie_in_fit(monkeypatch, lie)
    cfg = _cfg(strategy="clustered", clusters=2, evaluate_every=0)
    run = RunDir(tmp_path / "run")
    # Execute
    summary = simulate(cfg, run, progress=False)
    # Assert: the liar is out of every round; the cluster weights hold no lie (q = 1/(1+ℓ) ≤ 1)
    assert summary["rounds"] == 2
    assert {e["client"] for e in _rejections(run)} == {LIAR}
    _, arrays = decode(server_state(run))
    assert np.all(arrays["strategy.quality"] <= 1.0)
    assert np.isfinite(arrays["strategy.weights"]).all()


def test_clustered_with_one_cluster_needs_no_loss_after(tmp_path: Path) -> None:
    # Honest clients send no loss_after when there is only one model to choose from.
    run = RunDir(tmp_path / "run")
    summary = simulate(_cfg(strategy="clustered", clusters=1, evaluate_every=0), run, progress=False)
    assert summary["rounds"] == 2 and not _rejections(run)


def test_clustered_evaluation_drops_a_model_out_of_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the liar says it scored cluster model −1 (np.bincount raised before)
    _lie_in_eval(monkeypatch, lambda rep: rep.metrics.update(model=-1))
    cfg = _cfg(strategy="clustered", clusters=2, evaluate_every=1, val_fraction=0.2)
    run = RunDir(tmp_path / "run")
    # Execute
    simulate(cfg, run, progress=False)
    # Assert: the honest clients' choices are counted, the liar's report is not
    rows = read_jsonl(run.metrics)
    assert all(sum(r["cluster_sizes"]) == r["evaluated_clients"] == 3 for r in rows)
    rejected = _rejections(run)
    assert rejected and all(e["client"] == LIAR and e["phase"] == "evaluate" for e in rejected)


def test_evaluation_drops_a_metric_that_overflows_the_weighted_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2^50 examples × a loss of 1e300 is inf: the clients' mean loss became inf before
    def lie(rep: EvalRes) -> None:
        rep.num_examples, rep.metrics["loss"] = 2**50, 1e300

    _lie_in_eval(monkeypatch, lie)
    run = RunDir(tmp_path / "run")
    simulate(_cfg(evaluate_every=1, val_fraction=0.2), run, progress=False)
    rows = read_jsonl(run.metrics)
    assert all(math.isfinite(r["client_loss"]) and r["evaluated_clients"] == 3 for r in rows)
    assert any("loss" in e["reason"] for e in _rejections(run))


def _dp_cfg(**privacy: Any) -> Config:
    dp = {"mode": "client", "clip_norm": 0.5, "adaptive_clip": True, **privacy}
    return _cfg(strategy="fedavg", rounds=3, privacy=dp)


@pytest.mark.parametrize("count", [-3e38, 3e38, 0.5])
def test_dp_adaptive_clipping_drops_a_count_no_client_can_send(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, count: float
) -> None:
    # Prepare: without secure aggregation and with no noise, the count coordinate is one bit
    _lie_in_fit(monkeypatch, lambda res: res.update.__setitem__(-1, count))
    cfg = _dp_cfg(noise_multiplier=0.0)
    run = RunDir(tmp_path / "run")
    # Execute: −3e38 raised OverflowError in math.exp; +3e38 set the clip norm to 0 for good
    simulate(cfg, run, progress=False)
    # Assert
    assert {e["client"] for e in _rejections(run)} == {LIAR}
    assert all("count" in e["reason"] for e in _rejections(run))
    clip = _checkpoint(run)["hook"]["clip_norm"]
    assert 0.5 * math.exp(-0.2 * 3) <= clip <= 0.5 * math.exp(0.2 * 3)  # three honest steps at most


def test_dp_adaptive_clipping_keeps_honest_noisy_counts(tmp_path: Path) -> None:
    # Noise added at the clients makes the count any real number; honest ones are never refused.
    cfg = _dp_cfg(noise_multiplier=0.3, noise_at="clients")
    run = RunDir(tmp_path / "run")
    simulate(cfg, run, progress=False)
    assert not _rejections(run)


def test_dp_client_mode_drops_an_update_over_the_clip_norm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Noise at the server is calibrated to the clip norm: an unclipped upload would void it.
    _lie_in_fit(monkeypatch, lambda res: res.update.__setitem__(0, 100.0))
    run = RunDir(tmp_path / "run")
    simulate(_dp_cfg(noise_multiplier=0.3, noise_at="server"), run, progress=False)
    assert {e["client"] for e in _rejections(run)} == {LIAR}
    assert all("clip" in e["reason"] for e in _rejections(run))


@pytest.mark.parametrize("count", [math.inf, math.nan, 1e300, -1e300])
def test_the_clip_norm_stays_positive_and_finite_whatever_the_count(count: float) -> None:
    # Defense in depth: a secure sum's count cannot be checked per client; the step is clamped.
    hook = PrivateUpload(_dp_cfg(noise_multiplier=0.0))
    hook._privatize(np.zeros(4), 3, 3, count)
    assert math.isfinite(hook.clip_norm) and hook.clip_norm > 0
