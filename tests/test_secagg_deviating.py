"""Secure aggregation against a deviating server and lying parties: a second sum, the weight, a liar's cost.

The test plays the server: it drives :class:`ClientParty` endpoints (the clients' side, as deployed)
in-process, and runs whatever protocol runs it likes over them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from tests.conftest import small_config

from vatra.config import SecureAggregationConfig, config_from_dict
from vatra.errors import ConfigError
from vatra.federated import FitIns, FitRes
from vatra.federated.private import build_private_hook
from vatra.federated.secagg import (
    ClientParty,
    LocalParties,
    Quantizer,
    RoundAborted,
    SecAggServer,
    secure_sum,
)
from vatra.federated.secagg import server as secagg_server
from vatra.federated.secagg.channel import CountingChannel
from vatra.federated.secagg.crypto import PRIME, bytes_int, int_bytes
from vatra.rundir import RunDir

DIM = 8


class Devices(CountingChannel):
    """The clients' endpoints, reached in-process: each answers, or refuses with a reason."""

    def __init__(self, parties: dict[int, ClientParty]) -> None:
        super().__init__()
        self.parties = parties

    def deliver(self, stage: str, rnd: int, blobs: dict[int, bytes]) -> dict[int, bytes | str]:
        return {c: self.parties[c].respond_or_refuse(blob) for c, blob in blobs.items()}


def _words(x: np.ndarray) -> Callable[[int], np.ndarray]:
    return lambda n1: Quantizer(32, 1.0, n1).encode(x)


def test_a_second_sum_over_the_same_updates_is_refused_so_the_victims_update_stays_hidden() -> None:
    # Prepare: 5 clients train round 1. The server runs round 1 with everyone, then — asking nobody
    # to train — a "round 2" and a second "round 1" without client 0: unguarded, the difference of
    # the two sums would be client 0's update.
    n = 5
    cfg = SecureAggregationConfig(enabled=True)
    rng = np.random.default_rng(7)
    xs = {c: rng.uniform(-1, 1, DIM) for c in range(n)}
    parties = {c: ClientParty(c, cfg) for c in range(n)}
    for c in range(n):
        parties[c].trained(1, _words(xs[c]))
    devices = Devices(parties)
    # Execute: the honest round, then the two replays
    first = secure_sum(SecAggServer(1, cfg, list(range(n)), DIM, seed=1), devices)
    replays = []
    for rnd in (2, 1):
        server = SecAggServer(rnd, cfg, list(range(1, n)), DIM, seed=2)
        with pytest.raises(RoundAborted, match="0 client"):
            secure_sum(server, devices)
        replays.append((server, dict(devices.rejected)))
    # Assert: the honest round is exact; in each replay every client refused the advertise, so
    # the server got no key, no share and no masked vector.
    q = Quantizer(32, 1.0, n)
    np.testing.assert_allclose(q.decode_sum(first), sum(xs.values()), atol=q.max_error(n), rtol=0)
    for server, rejected in replays:
        assert sorted(rejected) == [1, 2, 3, 4]
        assert all("no update left to mask" in why for why in rejected.values())
        assert not server.keys and not server.masked
    # the next round, trained, still works
    for c in range(n):
        parties[c].trained(3, _words(-xs[c]))
    third = secure_sum(SecAggServer(3, cfg, list(range(n)), DIM, seed=3), devices)
    np.testing.assert_allclose(q.decode_sum(third), -sum(xs.values()), atol=q.max_error(n), rtol=0)


def test_an_advertise_for_a_round_not_trained_is_refused_and_uses_the_update_up() -> None:
    cfg = SecureAggregationConfig(enabled=True)
    parties = {c: ClientParty(c, cfg) for c in range(4)}
    for c in range(4):
        parties[c].trained(3, _words(np.full(DIM, 0.5)))
    devices = Devices(parties)
    with pytest.raises(RoundAborted):  # round 4 was never trained
        secure_sum(SecAggServer(4, cfg, list(range(4)), DIM), devices)
    assert all("its update is round 3's" in why for why in devices.rejected.values())
    with pytest.raises(RoundAborted):  # one run per update: round 3's is gone with the refusal
        secure_sum(SecAggServer(3, cfg, list(range(4)), DIM), devices)
    assert all("no update left to mask" in why for why in devices.rejected.values())


# ---------------------------------------------------------------- the weight word (bits < 32)


class _Trainer:
    """Stands for the client devices' training: every client returns ``update`` with ``samples``."""

    def __init__(self, update: np.ndarray, samples: int) -> None:
        self.update, self.samples = update, samples

    def fit(self, rnd: int, ins: dict[int, FitIns], expected: int) -> tuple[list[FitRes], list, int, int]:
        return [FitRes(c, rnd, self.samples, self.update.copy(), {}) for c in ins], [], 0, 0


def _private_round(
    cfg: Any, update: np.ndarray, samples: int, lie: Callable | None = None, run: RunDir | None = None
) -> list[FitRes]:
    hook = build_private_hook(cfg, run)
    assert hook is not None
    executor = hook.wrap(_Trainer(update, samples))
    if lie is not None:
        executor.link.inputs = lie(executor.link.inputs)
    clients = cfg.federated.clients
    meta, *_ = executor.fit(1, {c: FitIns(c, 1, [], {}) for c in range(clients)}, update.size)
    return hook.combine(1, meta)


def test_a_16_bit_ring_gives_fedavgs_mean_for_three_clients_of_30000_samples() -> None:
    # The sample counts sum to 90,000 > 2^16: the weight word used to wrap (a mean of 0.368).
    cfg = small_config(federated={"clients": 3, "secure_aggregation": {"enabled": True, "bits": 16}})
    out = _private_round(cfg, np.full(DIM, 0.1, np.float32), 30_000)
    assert len(out) == 1 and out[0].num_samples == 90_000
    # error: 3 clients × 0.5 step of 1/scale (scale = ⌊32767/3⌋) in w·Δ/max_weight units, × max_weight / Σw
    atol = 3 * 0.5 / (32767 // 3) * 100_000 / 90_000
    np.testing.assert_allclose(out[0].update, 0.1, atol=atol, rtol=0)


@pytest.mark.parametrize("bits", [16, 32])
def test_clients_at_plus_clip_sum_to_plus_clip_times_n(bits: int) -> None:
    # round-to-nearest of (2^(bits−1) − 1)/2 used to give each of 2 clients one step too many:
    # the sum wrapped to −2·clip
    q = Quantizer(bits, 1.0, 2)
    words = q.encode(np.array([1.0, -1.0]))
    np.testing.assert_allclose(q.decode_sum(words + words), [2.0, -2.0], atol=q.max_error(2), rtol=0)


@pytest.mark.parametrize(
    ("federated", "why"),
    [
        (
            {"clients": 40_000, "secure_aggregation": {"enabled": True, "bits": 16}},
            "bits = 16: a round of 40000 clients needs at least 40000 quantization steps, the 16-bit "
            "sum holds 32767; set bits to 17 or more",
        ),
        (
            {"clients": 5_000, "secure_aggregation": {"enabled": True, "max_weight": 1_000_000}},
            "max_weight = 1000000: 5000 clients' summed weight could reach 5000000000, past the 32-bit "
            "weight word; set max_weight to 858993 or less",
        ),
    ],
)
def test_a_ring_too_small_for_the_round_is_a_one_line_config_error(federated: dict, why: str) -> None:
    raw = {"data": {"name": "digits"}, "federated": federated}
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert str(err.value) == f"federated: secure_aggregation.{why}"
    federated["secure_aggregation"]["enabled"] = False  # the same numbers without secure aggregation load
    config_from_dict(raw)


def test_a_client_masking_a_weight_above_max_weight_gets_the_round_refused(tmp_path: Any) -> None:
    # Client 2 masks a weight of 2^31 (an honest one caps its sample count at max_weight): the sum
    # hides who lied, so the round's result is refused and logged, never used.
    cfg = small_config(federated={"clients": 3, "secure_aggregation": {"enabled": True, "max_weight": 1000}})

    def lie(inputs: Callable) -> Callable:
        def words(cid: int, n1: int) -> np.ndarray:
            out = inputs(cid, n1)
            if cid == 2:
                out[-1] = 2**31
            return out

        return words

    run = RunDir(tmp_path)
    assert _private_round(cfg, np.full(DIM, 0.1, np.float32), 500, lie, run) == []
    events = [json.loads(line) for line in run.events.read_text().splitlines()]
    refused = [e for e in events if e.get("event", e.get("kind")) == "secagg_weight_refused"]
    assert (
        len(refused) == 1
        and "summed weight 2147484648 of 3 clients, each at most 1000" in refused[0]["reason"]
    )


# ---------------------------------------------------------------- a lying share holder's cost


@pytest.mark.parametrize("liars", [(0,), (0, 3)])
def test_a_lying_holder_costs_a_few_decodes_not_one_per_secret(
    liars: tuple[int, ...], monkeypatch: Any
) -> None:
    # Prepare: 16 clients, t = 9, 2 vanish after share_keys: each secret has 14 shares, so
    # Berlekamp–Welch corrects ⌊(14 − 9)/2⌋ = 2 wrong ones. The lowest-id holders reveal a wrong
    # share of every secret they hold a share of (self-mask seeds and mask keys): every secret's
    # fast path fails at first.
    n = 16
    cfg = SecureAggregationConfig(enabled=True, threshold=9)
    rng = np.random.default_rng(16)
    xs = {c: rng.uniform(-1, 1, DIM) for c in range(n)}
    parties = LocalParties(cfg, lambda cid, n1: Quantizer(32, 1.0, n1).encode(xs[cid]))
    parties.trained(1, range(n))
    parties.drops[(1, "masked_input")] = {14, 15}
    server = SecAggServer(1, cfg, list(range(n)), DIM, seed=4)
    finish = server.finish

    def lie(replies: dict[int, dict]) -> np.ndarray:
        for h in liars:
            for kind in ("b_shares", "s_shares"):
                shares = dict(replies[h][kind])
                replies[h] = {
                    **replies[h],
                    kind: {v: int_bytes((bytes_int(s) + 1) % PRIME) for v, s in shares.items()},
                }
        return finish(replies)

    server.finish = lie  # type: ignore[method-assign]
    decodes = []
    decode = secagg_server.decode_shares

    def counted(shares: dict[int, int], t: int) -> tuple[bytes, list[int]]:
        decodes.append(len(shares))
        return decode(shares, t)

    monkeypatch.setattr(secagg_server, "decode_shares", counted)
    # Execute
    total = secure_sum(server, parties)
    # Assert: the exact sum of the 14 survivors; the liars, and only they, are blamed; one
    # Berlekamp–Welch decode names both liars here (each is off the polynomial of the first secret).
    q = Quantizer(32, 1.0, n)
    np.testing.assert_allclose(
        q.decode_sum(total), sum(xs[c] for c in range(14)), atol=q.max_error(n), rtol=0
    )
    assert sorted(server.rejected) == list(liars)
    assert all("off the sharing polynomial" in server.rejected[h] for h in liars)
    assert len(decodes) == 1
