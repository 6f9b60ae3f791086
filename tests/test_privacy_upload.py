"""The private upload path, client to server: what leaves a client, its clipping and noise, the clip
count, and the hook's checkpoint state. Clients are played by :class:`_Clients`, which encodes each
update with its own hook and ships the wire bytes, as a worker or a device does."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from tests.conftest import small_config

from vatra.config import Config
from vatra.errors import ConfigError, VatraError
from vatra.federated._base import EvalRes, Failure, FitIns, FitRes
from vatra.federated.privacy import (
    EVAL_METRICS_WHITELIST,
    FIT_METRICS_WHITELIST,
    Accountant,
    filter_eval_metrics,
)
from vatra.federated.privacy import hook as hook_module
from vatra.federated.private import PrivateUpload
from vatra.federated.wire import check_update, decode, decode_res, encode_res

CLIENT_METRICS = {  # everything a client's training reports (client.py)
    "loss_before": 2.3,
    "loss_after": 1.7,
    "train_loss": 1.9,
    "train_time_s": 0.4,
    "duration_s": 0.5,
    "model": 1,
    "local_accuracy": 0.8,
    "update_norm": 3.0,
}
SIX = 6  # update length


def _cfg(
    clients: int = 6, per_round: int = 3, strategy: str = "fedavg", sa: bool = False, **privacy: Any
) -> Config:
    return small_config(
        federated={
            "strategy": strategy,
            "clients": clients,
            "clients_per_round": per_round,
            "selection": "random",
            "workers": 1,
            "privacy": privacy,
            "secure_aggregation": {"enabled": sa},
        }
    )


class _Clients:
    """Client devices for one round: update ``updates[cid]``, encoded by a client-side hook, sent as bytes."""

    def __init__(self, cfg: Config, updates: dict[int, np.ndarray]) -> None:
        self.hook = PrivateUpload(cfg)  # its own object, as in a worker process
        self.updates = updates
        self.uploads: dict[int, bytes] = {}

    def available(self) -> list[int]:
        return sorted(self.updates)

    def fit(
        self, rnd: int, ins: dict[int, FitIns], expected: int
    ) -> tuple[list[FitRes], list[Failure], int, int]:
        results, failures = [], []
        for cid, task in sorted(ins.items()):
            res = FitRes(cid, rnd, 10, self.updates[cid].astype(np.float32), dict(CLIENT_METRICS))
            self.uploads[cid] = encode_res(self.hook.encode(res, task))
            got = decode_res(self.uploads[cid])
            if reason := check_update(got, expected):
                failures.append(Failure(cid, reason))
            else:
                results.append(got)
        return results, failures, 0, sum(map(len, self.uploads.values()))

    def close(self) -> None:
        pass


def _round(server: PrivateUpload, clients: _Clients, rnd: int = 1) -> list[FitRes]:
    """One round's upload path: tasks out through the server's wrapper, uploads in, combined."""
    channel = server.wrap(clients)
    ins = {c: FitIns(c, rnd, [np.zeros(SIX, np.float32)], {"local_steps": 1}) for c in clients.updates}
    results, _, _, _ = channel.fit(rnd, ins, SIX)
    return server.combine(rnd, results)


def _norm(v: np.ndarray, n: float) -> np.ndarray:
    return v / np.linalg.norm(v) * n


PRIVATE_SETUPS: dict[str, tuple[dict[str, Any], bool]] = {
    "client-dp": ({"mode": "client", "noise_multiplier": 0.5}, False),
    "client-dp-adaptive-at-clients-secagg": (
        {"mode": "client", "noise_multiplier": 0.2, "noise_at": "clients", "adaptive_clip": True},
        True,
    ),
    "sample-dp": ({"mode": "sample"}, False),
    "secagg-only": ({}, True),
}


@pytest.mark.parametrize("setup", sorted(PRIVATE_SETUPS))
def test_uploads_carry_only_the_whitelisted_metrics(setup: str) -> None:
    # Prepare
    privacy, sa = PRIVATE_SETUPS[setup]
    cfg = _cfg(sa=sa, **privacy)
    rng = np.random.default_rng(0)
    clients = _Clients(cfg, {c: rng.normal(size=SIX) for c in range(3)})
    # Execute
    merged = _round(PrivateUpload(cfg), clients)
    # Assert: the bytes that left each client name no loss, norm, clip bit, cluster or accuracy
    for blob in clients.uploads.values():
        meta, _ = decode(blob)
        assert set(meta["metrics"]) == set(FIT_METRICS_WHITELIST)
        for word in (b"loss", b"norm", b"unclipped", b"model", b"accuracy"):
            assert word not in blob
    assert merged and all(set(r.metrics) <= set(FIT_METRICS_WHITELIST) for r in merged)


def test_a_deployed_secagg_client_keeps_its_update_and_says_only_the_whitelist() -> None:
    cfg = _cfg(sa=True, mode="client", noise_multiplier=0.2, noise_at="clients", adaptive_clip=True)
    device = PrivateUpload(cfg, device=True)
    res = FitRes(0, 1, 10, np.ones(SIX, np.float32), dict(CLIENT_METRICS))
    notice = device.encode(res, FitIns(0, 1, [], {"dp_clip_norm": 1.0, "dp_clients": 3}))
    assert notice.update.size == 0 and set(notice.metrics) == set(FIT_METRICS_WHITELIST)
    assert device.party is not None and device.party.update is not None
    rnd, words = device.party.update  # what it masks in round 1's run: Δ, the clip bit, the weight
    assert rnd == 1 and words(3).size == SIX + 2


def test_evaluation_reports_keep_accuracy_and_count_only() -> None:
    reply = {"accuracy": 0.9, "num_examples": 40, "loss": 0.3, "model": 1, "per_class": [1.0, 0.8]}
    assert EVAL_METRICS_WHITELIST == ("accuracy", "num_examples")
    assert filter_eval_metrics(reply) == {"accuracy": 0.9, "num_examples": 40}
    assert filter_eval_metrics({"loss": 1.0}) == {}
    report = PrivateUpload(_cfg(mode="client")).encode_eval(EvalRes(0, 1, 40, dict(reply)))
    assert report.metrics == {"accuracy": 0.9, "num_examples": 40} and report.num_examples == 40


@pytest.mark.parametrize("sa", [False, True], ids=["plain-sum", "secagg"])
def test_the_clip_count_travels_as_a_coordinate_of_the_summed_update(sa: bool) -> None:
    # Prepare: C = 1, norms 0.5, 3, 0.2 → two unclipped; no noise, so the step is exact
    cfg = _cfg(sa=sa, mode="client", noise_multiplier=0.0, clip_norm=1.0, adaptive_clip=True, clip_lr=0.2)
    base = np.arange(1.0, SIX + 1.0)
    updates = {0: _norm(base, 0.5), 1: _norm(-base, 3.0), 2: _norm(base[::-1], 0.2)}
    clients = _Clients(cfg, updates)
    server = PrivateUpload(cfg)
    # Execute
    merged = _round(server, clients)
    # Assert: each upload is [clipped Δ, bit]; the server saw the count only inside the sum
    for cid, blob in clients.uploads.items():
        upload = decode_res(blob).update
        assert upload.shape == (SIX + 1,) and upload[-1] == float(np.linalg.norm(updates[cid]) <= 1.0)
    assert server.clip_norm == pytest.approx(math.exp(-0.2 * (2 / 3 - 0.5)), rel=1e-6)
    clipped = [updates[0], _norm(-base, 1.0), updates[2]]
    np.testing.assert_allclose(merged[0].update, np.mean(clipped, axis=0), atol=1e-6)  # fixed point: ~1e-9
    assert merged[0].update.shape == (SIX,)


def _noise_only(cfg: Config, m: int, clip: float, d: int) -> np.ndarray:
    """One client's upload of a zero update (never clipped): its noise share and, last, its clip bit."""
    res = FitRes(0, 1, 10, np.zeros(d, np.float32), {})
    return PrivateUpload(cfg).encode(res, FitIns(0, 1, [], {"dp_clip_norm": clip, "dp_clients": m})).update


def _assert_std(x: np.ndarray, sigma: float) -> None:
    """n·s²/σ² ~ χ²(n): s²/σ² within 6·√(2/n) of 1, and the mean within 6σ/√n of 0."""
    x = x.astype(np.float64)
    assert float(np.mean(x**2)) / sigma**2 == pytest.approx(1.0, abs=6 * math.sqrt(2 / x.size))
    assert abs(float(np.mean(x))) < 6 * sigma / math.sqrt(x.size)


def test_client_noise_share_is_z_c_over_sqrt_m_and_the_round_sum_z_c() -> None:
    # Prepare: 250k coordinates pin σ to ±0.9 %; a σ off by 10 % misses by > 10 bound widths
    z, clip, m, d = 1.3, 0.7, 4, 250_000
    cfg = _cfg(mode="client", noise_multiplier=z, clip_norm=clip, noise_at="clients")
    # Execute
    shares = [_noise_only(cfg, m, clip, d) for _ in range(m)]
    # Assert
    _assert_std(shares[0], z * clip / math.sqrt(m))
    _assert_std(np.stack(shares).astype(np.float64).sum(axis=0), z * clip)


def test_adaptive_clipping_splits_z_between_the_update_and_the_count() -> None:
    # Prepare: m = 40 per round → σ_b = 2; z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) = 1.375 for z = 1.3
    z, clip, m = 1.3, 0.7, 40
    cfg = _cfg(
        clients=100,
        per_round=m,
        mode="client",
        noise_multiplier=z,
        clip_norm=clip,
        noise_at="clients",
        adaptive_clip=True,
    )
    z_update = (z**-2 - (2 * m / 20) ** -2) ** -0.5
    # Execute
    upload = _noise_only(cfg, m, clip, 250_000)
    counts = np.array([_noise_only(cfg, m, clip, 1)[-1] for _ in range(20_000)])
    # Assert: the update's share uses z_Δ (5.7 % above z: outside the bound), the count's σ_b/√m
    _assert_std(upload[:-1], z_update * clip / math.sqrt(m))
    _assert_std(counts - 1.0, (m / 20) / math.sqrt(m))  # the bit of a zero update is 1


def test_server_noise_on_the_sum_is_z_c() -> None:
    z, clip = 1.3, 0.7
    cfg = _cfg(mode="client", noise_multiplier=z, clip_norm=clip, noise_at="server")
    server = PrivateUpload(cfg)
    merged = server.combine(1, [FitRes(0, 1, 10, np.zeros(250_000, np.float32), {})])
    _assert_std(merged[0].update, z * clip)  # one client: the mean is the sum


class _Recorder:
    """Stands for ``_secure_rng()``: real Gaussian draws, each one kept so the test can subtract it."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.draws: list[np.ndarray] = []

    def __call__(self) -> _Recorder:
        return self

    def normal(self, loc: float, scale: float, size: int) -> np.ndarray:
        self.draws.append(self.rng.normal(loc, scale, size))
        return self.draws[-1]


def test_every_upload_is_clipped_to_c_before_its_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: adversarial updates around and far beyond C, one coordinate huge, one non-finite
    clip, d = 0.5, 1000
    cfg = _cfg(mode="client", noise_multiplier=0.8, clip_norm=clip, noise_at="clients")
    rng = np.random.default_rng(3)
    direction = rng.normal(size=d)
    norms = [0.0, 1e-3, 0.999 * clip, clip, 1.001 * clip, 10 * clip, 1e6 * clip]
    updates = [_norm(direction, n) if n else np.zeros(d) for n in norms]
    spike = np.zeros(d)
    spike[7] = 3e38
    updates.append(spike)
    recorder = _Recorder()
    monkeypatch.setattr(hook_module, "_secure_rng", recorder)
    client = PrivateUpload(cfg)
    for update in updates:
        recorder.draws.clear()
        # Execute
        res = FitRes(0, 1, 10, update.astype(np.float32), {})
        upload = client.encode(res, FitIns(0, 1, [], {"dp_clip_norm": clip, "dp_clients": 3})).update
        # Assert: upload − noise is the clipped update: norm ≤ C, direction kept, small ones untouched
        before = upload.astype(np.float64) - recorder.draws[0]
        norm = float(np.linalg.norm(update))
        assert np.linalg.norm(before) <= clip * (1 + 1e-5)
        expected = update * min(1.0, clip / norm) if norm else update
        np.testing.assert_allclose(before, expected, atol=1e-5 * clip)
    res = FitRes(0, 1, 10, np.full(d, np.inf, np.float32), {})
    with np.errstate(invalid="ignore"):  # inf · 0
        poisoned = client.encode(res, FitIns(0, 1, [], {"dp_clip_norm": clip, "dp_clients": 3}))
    assert check_update(poisoned, d) is not None  # not finite: the server rejects it, never unclipped


def test_dropped_clients_lower_the_effective_noise_multiplier() -> None:
    # Prepare: 3 clients get a noise share of 1/3 each; client 2 sends NaN and is rejected
    z = 1.0
    cfg = _cfg(mode="client", noise_multiplier=z, noise_at="clients")
    updates = {0: np.ones(SIX), 1: -np.ones(SIX), 2: np.full(SIX, np.nan)}
    server = PrivateUpload(cfg)
    # Execute
    _round(server, _Clients(cfg, updates))
    # Assert: two shares of variance reached the sum: z·√(2/3), and the accountant stepped with it
    assert server.facts["dp_noise_multiplier"] == pytest.approx(z * math.sqrt(2 / 3))
    assert server.accountant.history() == [[pytest.approx(z * math.sqrt(2 / 3)), 0.5, 1]]


def _rows_of(server: PrivateUpload, clients: _Clients, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for rnd in range(1, rounds + 1):
        _round(server, clients, rnd)
        row: dict[str, Any] = {"round": rnd}
        server.round_metrics(rnd, row)
        rows.append(json.loads(json.dumps(row)))
    return rows


def test_state_round_trips_through_json_and_replaces_the_rebuild_from_rows() -> None:
    # Prepare: three rounds of DP-FedAvg with adaptive clipping
    cfg = _cfg(mode="client", noise_multiplier=0.25, noise_at="clients", adaptive_clip=True)
    rng = np.random.default_rng(1)
    clients = _Clients(cfg, {c: rng.normal(size=SIX) for c in range(3)})
    live = PrivateUpload(cfg)
    rows = _rows_of(live, clients, 3)
    # Execute
    restored = PrivateUpload(cfg)
    restored.load_state(json.loads(json.dumps(live.state())))
    rebuilt = PrivateUpload(cfg)
    rebuilt.resume(rows)  # the fallback for a checkpoint written before the hook had a state
    # Assert: the clip norm and ε go on from where they were, either way
    fresh = Accountant(1e-5)
    fresh.step(0.25, 0.5, 3)
    for hook in (restored, rebuilt):
        assert hook.clip_norm == live.clip_norm != cfg.federated.privacy.clip_norm
        assert hook.accountant.epsilon() == pytest.approx(fresh.epsilon(), rel=1e-12)
        assert hook.accountant.epsilon_after(0.25, 0.5) == live.accountant.epsilon_after(0.25, 0.5)


def test_sample_level_per_client_accountants_are_in_the_state() -> None:
    cfg = _cfg(mode="sample", noise_multiplier=1.0)
    live = PrivateUpload(cfg)
    row: dict[str, Any] = {}
    for rnd, samples in enumerate([{0: 40, 3: 80}, {3: 80, 5: 20}], start=1):
        live.samples = samples
        live.round_metrics(rnd, row)
    restored = PrivateUpload(cfg)
    restored.load_state(json.loads(json.dumps(live.state())))
    assert sorted(restored.per_client) == [0, 3, 5]
    for cid, acc in live.per_client.items():
        assert restored.per_client[cid].epsilon() == acc.epsilon() > 0
    again: dict[str, Any] = {}
    restored.round_metrics(3, again)
    assert again["epsilon"] == row["epsilon"]  # no client trained in round 3: the max ε is unchanged


def test_a_malformed_state_is_one_clear_error() -> None:
    hook = PrivateUpload(_cfg(mode="client"))
    with pytest.raises(VatraError, match="privacy state is malformed"):
        hook.load_state({"clip_norm": 1.0, "accountant": [[1.0, 0.5]], "per_client": {}})
    with pytest.raises(VatraError, match="privacy state is malformed"):
        hook.load_state({})


@pytest.mark.parametrize(("privacy", "sa"), [({"mode": "sample"}, False), ({}, True)])
def test_clustered_is_refused_under_privacy(privacy: dict[str, Any], sa: bool) -> None:
    with pytest.raises(ConfigError, match="clustered"):
        PrivateUpload(_cfg(strategy="clustered", sa=sa, **privacy))
