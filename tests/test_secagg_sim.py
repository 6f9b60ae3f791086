"""Secure aggregation in ``simulate``: the plain FedAvg model, drop-outs survived, aborts keep the model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tests.conftest import small_config

from vatra.federated.checkpoint import server_state
from vatra.federated.simulation import simulate
from vatra.federated.wire import decode
from vatra.rundir import RunDir, read_jsonl


def _cfg(chaos: dict | None = None, **sa: object):
    return small_config(
        federated={
            "strategy": "fedavg",
            "clients": 6,
            "clients_per_round": 6,
            "selection": "all",
            "rounds": 2,
            "local_steps": 2,
            "workers": 1,
            "secure_aggregation": {"enabled": bool(sa), **sa},
        },
        chaos={"drop_clients_at": chaos},
    )


def _weights(run: Path) -> np.ndarray:
    _, tensors = decode(server_state(RunDir(run)))
    return tensors["strategy.weights"]


def test_secure_aggregation_matches_plain_fedavg(tmp_path: Path) -> None:
    plain = simulate(_cfg(), RunDir(tmp_path / "plain"), progress=False)
    secure = simulate(_cfg(enabled=True), RunDir(tmp_path / "secure"), progress=False)
    # quantization: 6 clients × 0.5 / scale per coordinate per round, scale = (2^31−1)/(6·1) on w·Δ/max_weight
    np.testing.assert_allclose(_weights(tmp_path / "secure"), _weights(tmp_path / "plain"), atol=1e-3, rtol=0)
    assert secure["secure_aggregation"] == {
        "mode": "full",
        "threshold": 4,
        "dropouts_survived": 0,
        "rounds_aborted": 0,
    }
    rows = read_jsonl(RunDir(tmp_path / "secure").metrics)
    assert all(r["secagg_survivors"] == 6 for r in rows)
    assert rows[0]["bytes_up"] > plain["bytes_up"] / 2  # masked vectors travel in the protocol stages


def test_dropouts_survived_and_abort_keeps_the_model(tmp_path: Path) -> None:
    # 6 clients, t = 4: two may vanish (n − t), three may not (n − t + 1)
    two = _cfg({"round": 2, "stage": "masked_input", "count": 2}, enabled=True)
    summary = simulate(two, RunDir(tmp_path / "drop2"), progress=False)
    assert summary["secure_aggregation"]["dropouts_survived"] == 2
    run = RunDir(tmp_path / "drop3")
    three = _cfg({"round": 2, "stage": "unmask", "count": 3}, enabled=True)
    summary = simulate(three, run, progress=False)
    assert summary["secure_aggregation"]["rounds_aborted"] == 1
    rows = read_jsonl(run.metrics)
    assert rows[1]["secagg_aborted"] and rows[0]["global_accuracy"] == rows[1]["global_accuracy"]
    events = [json.loads(line) for line in run.events.read_text().splitlines()]
    assert any(e.get("event", e.get("kind")) == "secagg_aborted" for e in events)
