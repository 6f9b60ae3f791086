"""Secure aggregation against a server that deviates: each attack is refused or detected.

The test plays the server (or a lying client) by rewriting requests and replies on their way;
each test names the leak that the unguarded protocol would allow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from vatra.config import SecureAggregationConfig
from vatra.errors import ConfigError
from vatra.federated.secagg import (
    STAGES,
    ClientParty,
    LocalParties,
    Quantizer,
    RoundAborted,
    SecAggServer,
    secure_sum,
)
from vatra.federated.secagg.crypto import PRIME, SecAggError, bytes_int, int_bytes
from vatra.federated.secagg.messages import pack, unpack

DIM = 8


def _setup(
    n: int,
    client_cfg: SecureAggregationConfig | None = None,
    server_cfg: SecureAggregationConfig | None = None,
):
    server_cfg = server_cfg or SecureAggregationConfig(enabled=True)
    client_cfg = client_cfg or server_cfg
    rng = np.random.default_rng(n)
    xs = {c: rng.uniform(-1, 1, DIM) for c in range(n)}
    parties = LocalParties(client_cfg, lambda cid, n1: Quantizer(32, 1.0, n1).encode(xs[cid]))
    parties.trained(1, range(n))
    return xs, parties, SecAggServer(1, server_cfg, list(range(n)), DIM, seed=n)


def _exact(xs: dict[int, np.ndarray], counted: list[int], n1: int) -> np.ndarray:
    """The sum the honest protocol gives: the clients' quantized words, added mod 2^32."""
    q = Quantizer(32, 1.0, n1)
    return np.asarray(np.sum([q.encode(xs[c]) for c in counted], axis=0, dtype=np.uint32))


def _to_unmask(n: int) -> tuple[dict[int, np.ndarray], LocalParties, SecAggServer, dict[int, dict]]:
    """Run advertise, share_keys and masked_input honestly; the unmask requests the server would send."""
    xs, parties, server = _setup(n)
    replies = parties.exchange("advertise", 1, server.advertise_requests())
    replies = parties.exchange("share_keys", 1, server.share_keys_requests(replies))
    replies = parties.exchange("masked_input", 1, server.masked_input_requests(replies))
    return xs, parties, server, server.unmask_requests(replies)


def test_second_unmask_with_other_survivors_is_refused() -> None:
    # Prepare: 5 clients, t = 4, every stage answered. The server first says all 5 survived
    # (collecting shares of each b_v), then asks 0-3 again with U3 = {0, 1, 2, 3}: unguarded,
    # they would now reveal shares of s_sk_4 too, and b_4 with s_sk_4 unmask x_4 alone.
    _, parties, _, _ = _to_unmask(5)
    first = {
        c: unpack(parties.parties[c].respond(pack("unmask", 1, {"u3": [0, 1, 2, 3, 4]})))[2] for c in range(4)
    }
    # Execute / Assert: every second unmask is refused; nobody revealed any mask key.
    for c in range(4):
        with pytest.raises(SecAggError, match="unmask request in round 1, expected nothing"):
            parties.parties[c].respond(pack("unmask", 1, {"u3": [0, 1, 2, 3]}))
    assert all(4 in dict(r["b_shares"]) and not len(r["s_shares"]) for r in first.values())


class _Repeat(LocalParties):
    """Delivers ``stage`` twice to client 0 and keeps what the second delivery got."""

    def __init__(self, cfg: SecureAggregationConfig, inputs: Any, stage: str) -> None:
        super().__init__(cfg, inputs)
        self.stage = stage
        self.second: str | bytes = ""

    def deliver(self, stage: str, rnd: int, blobs: dict[int, bytes]) -> dict[int, bytes | str]:
        out = super().deliver(stage, rnd, blobs)
        if stage == self.stage and 0 in blobs:
            try:
                self.second = self.parties[0].respond(blobs[0])
            except SecAggError as err:
                self.second = str(err)
        return out


@pytest.mark.parametrize("stage", STAGES)
def test_a_repeated_stage_is_refused_and_ends_the_clients_round(stage: str) -> None:
    # Prepare: client 0 gets each request of ``stage`` twice (a server replaying a stage to get
    # fresh keys, fresh shares, a second masked vector or a second set of revealed shares).
    n = 6
    cfg = SecureAggregationConfig(enabled=True)
    xs = {c: np.full(DIM, 0.1 * c) for c in range(n)}
    parties = _Repeat(cfg, lambda cid, n1: Quantizer(32, 1.0, n1).encode(xs[cid]), stage)
    parties.trained(1, range(n))
    server = SecAggServer(1, cfg, list(range(n)), DIM)
    # Execute
    total = secure_sum(server, parties)
    # Assert: the repeat is refused and client 0 answers nothing more; the round completes
    # without it, and with its input if that was masked in already.
    assert isinstance(parties.second, str) and "refusing" in parties.second
    counted = range(n) if stage in ("masked_input", "unmask") else range(1, n)
    np.testing.assert_array_equal(total, _exact(xs, list(counted), n))


def test_out_of_order_stages_and_old_rounds_are_refused() -> None:
    party = ClientParty(0, SecureAggregationConfig(enabled=True))

    def words(n1: int) -> np.ndarray:
        return np.zeros(DIM, np.uint32)

    with pytest.raises(SecAggError, match="has not begun"):
        party.respond(pack("share_keys", 1, {}))
    party.trained(2, words)
    party.respond(pack("advertise", 2, {}))
    with pytest.raises(SecAggError, match="unmask request in round 2, expected share_keys"):
        party.respond(pack("unmask", 2, {"u3": [0, 1, 2]}))
    with pytest.raises(SecAggError, match="expected nothing"):  # the round is over for this client
        party.respond(pack("share_keys", 2, {}))
    with pytest.raises(SecAggError, match="no update left to mask"):  # a round cannot be run again
        party.respond(pack("advertise", 2, {}))
    with pytest.raises(SecAggError, match="no update left to mask"):
        party.respond(pack("advertise", 1, {}))
    with pytest.raises(SecAggError, match="train round 2 after round 2"):
        party.trained(2, words)
    party.trained(3, words)
    party.respond(pack("advertise", 3, {}))  # the next round, once trained, is fine


def _tamper(stage: str, cid: int, edit: Callable[[dict], dict]) -> Callable[[str, int, dict], dict]:
    return lambda s, c, req: edit(dict(req)) if (s, c) == (stage, cid) else req


def test_server_cannot_lower_the_threshold_or_shrink_the_roster() -> None:
    # Prepare: 6 clients, t = 4. The server asks client 0 for 1-of-6 shares (any single holder
    # would then give away b_0 and s_sk_0), and gives client 1 a roster of two neighbours.
    n = 6
    xs, parties, server = _setup(n)
    lower = _tamper("share_keys", 0, lambda req: {**req, "t": 1})
    shrink = _tamper("share_keys", 1, lambda req: {**req, "keys": {v: req["keys"][v] for v in (2, 3)}})
    parties.tamper = lambda s, c, req: shrink(s, c, lower(s, c, req))
    # Execute
    total = secure_sum(server, parties)
    # Assert: both refuse; the others' sum is exact.
    assert "threshold t = 1 is outside [4, 6]" in parties.rejected[0]
    assert "2 neighbours in a round of 6 clients, expected 5" in parties.rejected[1]
    np.testing.assert_array_equal(total, _exact(xs, [2, 3, 4, 5], n))


def test_clients_own_minimum_threshold_wins_over_the_servers() -> None:
    # The clients are configured with t = 5; a server configured with the default (t = 4 of 6)
    # gets refused by every client, so the round aborts rather than run at the lower t.
    _, parties, server = _setup(6, client_cfg=SecureAggregationConfig(enabled=True, threshold=5))
    with pytest.raises(RoundAborted, match="0 client"):
        secure_sum(server, parties)
    assert all("threshold t = 4 is outside [5, 6]" in why for why in parties.rejected.values())


@pytest.mark.parametrize(
    ("u3", "why"),
    [([0, 1, 2, 3, 99], "U3 names \\[99\\], not in its U2"), ([0, 1, 2], "3 survivors < threshold 4")],
)
def test_unmask_naming_a_stranger_or_too_few_survivors_is_refused(u3: list[int], why: str) -> None:
    # A U3 with a client that never dealt shares to this one, or below t, is refused.
    xs, parties, server = _setup(6)
    parties.tamper = _tamper("unmask", 0, lambda req: {"u3": u3})
    total = secure_sum(server, parties)
    assert why.replace("\\", "") in parties.rejected[0]
    np.testing.assert_array_equal(total, _exact(xs, list(range(6)), 6))  # x_0 was masked in: it counts


def _corrupt(table: Any, owner: int) -> dict[int, bytes]:
    shares = dict(table)
    shares[owner] = int_bytes((bytes_int(shares[owner]) + 1) % PRIME)
    return shares


@pytest.mark.parametrize("kind", ["b_shares", "s_shares"])
def test_corrupted_share_drops_its_sender_and_the_sum_stays_exact(kind: str) -> None:
    # Prepare: 9 clients, t = 6; client 8 vanishes after share_keys (so its mask key s_sk_8 is
    # rebuilt from the 8 others' shares: one wrong share can be corrected); holder 1 — one of
    # the t lowest, used by the fast path — sends a wrong share of client 0's seed (b_shares) or
    # of client 8's mask key (s_shares). Unchecked, the wrong secret would leave a random mask
    # in the sum.
    n = 9
    xs, parties, server = _setup(n)
    parties.drops[(1, "masked_input")] = {8}
    owner = 0 if kind == "b_shares" else 8
    finish = server.finish

    def lie(replies: dict[int, dict]) -> np.ndarray:
        replies[1] = {**replies[1], kind: _corrupt(replies[1][kind], owner)}
        return finish(replies)

    server.finish = lie  # type: ignore[method-assign,unused-ignore]
    # Execute
    total = secure_sum(server, parties)
    # Assert: the exact sum, and holder 1 is named.
    np.testing.assert_array_equal(total, _exact(xs, list(range(8)), n))
    assert "off the sharing polynomial" in server.rejected[1]


def test_too_many_corrupted_shares_abort_naming_the_client() -> None:
    # 6 holders, t = 4: one wrong share can be corrected, two cannot — the round aborts cleanly.
    _, parties, server = _setup(6)
    finish = server.finish

    def lie(replies: dict[int, dict]) -> np.ndarray:
        for h in (1, 4):
            replies[h] = {**replies[h], "b_shares": _corrupt(replies[h]["b_shares"], 0)}
        return finish(replies)

    server.finish = lie  # type: ignore[method-assign,unused-ignore]
    with pytest.raises(RoundAborted, match="client 0's self-mask seed cannot be rebuilt"):
        secure_sum(server, parties)


class _Garble(LocalParties):
    """Client 5's reply to ``stage`` is replaced by ``garble(reply)`` before the server reads it."""

    def __init__(self, cfg: SecureAggregationConfig, inputs: Any, stage: str, garble: Callable[[dict], Any]):
        super().__init__(cfg, inputs)
        self.stage, self.garble = stage, garble

    def exchange(self, stage: str, rnd: int, requests: dict[int, dict]) -> dict[int, Any]:
        replies = super().exchange(stage, rnd, requests)
        if stage == self.stage:
            replies[5] = self.garble(replies[5])
        return replies


GARBLE = {
    "not a dict": lambda r: [1, 2],
    "a field missing": lambda r: dict(list(r.items())[1:]),
    "wrong types": lambda r: dict.fromkeys(r, "x"),
}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("how", list(GARBLE))
def test_malformed_reply_drops_the_client_at_every_stage(stage: str, how: str) -> None:
    # Prepare: client 5's reply at ``stage`` is garbled (a buggy or hostile client).
    n = 6
    cfg = SecureAggregationConfig(enabled=True)
    xs = {c: np.full(DIM, 0.05 * c) for c in range(n)}
    parties = _Garble(cfg, lambda cid, n1: Quantizer(32, 1.0, n1).encode(xs[cid]), stage, GARBLE[how])
    parties.trained(1, range(n))
    server = SecAggServer(1, cfg, list(range(n)), DIM)
    # Execute
    total = secure_sum(server, parties)
    # Assert: the server drops client 5 and says why; the sum is exact. At unmask its masked
    # input is already in, and only its shares are ignored.
    assert 5 in server.rejected
    counted = list(range(n)) if stage == "unmask" else list(range(5))
    np.testing.assert_array_equal(total, _exact(xs, counted, len(server.keys)))


@pytest.mark.parametrize(("copy", "dropped"), [("another's", {4, 5}), ("its own", {5})])
def test_a_repeated_public_key_drops_its_senders_not_the_round(copy: str, dropped: set[int]) -> None:
    # Client 5 advertises client 4's s_pk, or its own c_pk as its s_pk: every client would refuse
    # a roster with a repeated key, so unchecked one client could stall every round.
    n = 7
    xs, parties, server = _setup(n)
    orig = server.share_keys_requests

    def copy_key(replies: dict[int, dict]) -> dict[int, dict]:
        source = replies[4]["s_pk"] if copy == "another's" else replies[5]["c_pk"]
        replies[5] = {**replies[5], "s_pk": source}
        return orig(replies)

    server.share_keys_requests = copy_key  # type: ignore[method-assign,unused-ignore]
    total = secure_sum(server, parties)
    assert set(server.rejected) == dropped
    counted = [c for c in range(n) if c not in dropped]
    np.testing.assert_array_equal(total, _exact(xs, counted, len(counted)))


def test_threshold_config_is_a_majority_of_the_holders() -> None:
    with pytest.raises(ValidationError, match="even k"):
        SecureAggregationConfig(mode="secagg+", neighbours=5)
    for t in (2, 6):  # k = 4: each secret has 5 holders, so t ∈ (2.5, 5]
        with pytest.raises(ValidationError, match=r"t must be in \(2.5, 5\]"):
            SecureAggregationConfig(mode="secagg+", neighbours=4, threshold=t)
    cfg = SecureAggregationConfig(enabled=True)
    assert [cfg.threshold_for(h) for h in (1, 2, 3, 6, 7, 100)] == [
        math.ceil(2 * h / 3) for h in (1, 2, 3, 6, 7, 100)
    ]
    # full mode: n is known when the round starts; t = 3 of 6 is not a majority
    server = SecAggServer(1, SecureAggregationConfig(enabled=True, threshold=3), list(range(6)), DIM)
    with pytest.raises(ConfigError, match="threshold = 3 is not more than half of the 6 share holders"):
        server.advertise_requests()


def test_a_deployed_client_trains_each_round_once_and_keeps_its_protocol_endpoint() -> None:
    # A server that re-ran a round over the same client with other survivors could subtract the
    # two sums: the client refuses to train a round it has already trained (or an older one).
    from tests.conftest import small_config

    from vatra.federated import FitIns, FitRes
    from vatra.federated.private import build_private_hook

    cfg = small_config(federated={"clients": 4, "secure_aggregation": {"enabled": True}})
    hook = build_private_hook(cfg, device=True)
    assert hook is not None

    def trained(rnd: int) -> FitRes:
        return FitRes(0, rnd, 10, np.full(5, 0.01, np.float32), {"duration_s": 1.0})

    ins = FitIns(0, 1, [np.zeros(5, np.float32)], {"local_steps": 1})
    notice = hook.encode(trained(1), ins)
    assert notice.update.size == 0  # the update stays on the client
    party = hook.party
    with pytest.raises(SecAggError, match="round 1 after round 1"):
        hook.encode(trained(1), ins)
    hook.encode(trained(2), FitIns(0, 2, ins.models, ins.config))
    assert hook.party is party  # one endpoint: its rounds-only-up rule spans rounds
