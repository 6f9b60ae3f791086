"""Secure aggregation protocol: exact sums under drop-outs, aborts below t, uniform masks, authentication."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from vatra.config import SecureAggregationConfig
from vatra.federated.secagg import STAGES, LocalParties, Quantizer, RoundAborted, SecAggServer, secure_sum
from vatra.federated.secagg.messages import unpack

DIM = 16


def _setup(n: int, mode: str = "full", k: int = 4, dim: int = DIM, seed: int = 0):
    cfg = SecureAggregationConfig(enabled=True, mode=mode, neighbours=k)
    rng = np.random.default_rng(seed)
    xs = {c: rng.uniform(-1, 1, dim) for c in range(n)}
    q = Quantizer(cfg.bits, cfg.clip, n)
    parties = LocalParties(cfg, lambda cid, n1: Quantizer(cfg.bits, cfg.clip, n1).encode(xs[cid]))
    parties.trained(1, range(n))
    server = SecAggServer(1, cfg, list(range(n)), dim, seed=seed)
    return cfg, xs, q, parties, server


# (n, stage) grid sampled so every n in 3…20 and every stage appears; each case tries 0…n−t drops
GRID = [(n, STAGES[n % 4]) for n in range(3, 21)]


@pytest.mark.parametrize(("n", "stage"), GRID)
def test_sum_survives_up_to_n_minus_t_dropouts(n: int, stage: str) -> None:
    t = math.ceil(2 * n / 3)
    for drops in sorted({0, (n - t) // 2, n - t}):
        _, xs, q, parties, server = _setup(n, seed=n * 100 + drops)
        parties.drops[(1, stage)] = set(range(n - drops, n))
        total = secure_sum(server, parties)
        q = Quantizer(32, 1.0, len(server.keys))  # clients scale by the round's advertised count
        # a client dropped before its masked input counts for nothing; at unmask its input is in
        counted = [c for c in range(n) if c < n - drops or stage == "unmask"]
        want = sum(xs[c] for c in counted)
        np.testing.assert_allclose(q.decode_sum(total), want, atol=q.max_error(n), rtol=0)
        assert server.survivors["summed"] == len(counted)


@pytest.mark.parametrize("stage", STAGES)
def test_one_dropout_too_many_aborts(stage: str) -> None:
    n = 7
    t = math.ceil(2 * n / 3)
    _, _, _, parties, server = _setup(n)
    parties.drops[(1, stage)] = set(range(n - (n - t + 1), n))
    with pytest.raises(RoundAborted, match=f"threshold t = {t}"):
        secure_sum(server, parties)


@pytest.mark.parametrize("stage", ["share_keys", "masked_input", "unmask"])
def test_secagg_plus_sparse_graph_sum(stage: str) -> None:
    n, k = 20, 6
    _, xs, q, parties, server = _setup(n, mode="secagg+", k=k, seed=3)
    parties.drops[(1, stage)] = {2, 11}
    total = secure_sum(server, parties)
    assert all(len(v) == k for v in server.graph.values())
    assert server.t == math.ceil(2 * (k + 1) / 3)
    counted = [c for c in range(n) if c not in {2, 11} or stage == "unmask"]
    np.testing.assert_allclose(q.decode_sum(total), sum(xs[c] for c in counted), atol=q.max_error(n), rtol=0)


def test_masked_upload_looks_uniform_and_differs_from_plain() -> None:
    n, dim = 5, 20_000
    _, xs, _, parties, server = _setup(n, dim=dim)
    seen: dict[int, np.ndarray] = {}
    orig = server.unmask_requests

    def spy(replies):  # what the server holds from each client: the masked words only
        seen.update({c: r["y"] for c, r in replies.items()})
        return orig(replies)

    server.unmask_requests = spy  # type: ignore[method-assign]
    secure_sum(server, parties)
    y = seen[0]
    plain = Quantizer(32, 1.0, n).encode(xs[0])
    assert not np.array_equal(y, plain)
    counts = np.bincount((y >> np.uint64(24)).astype(np.int64), minlength=256)  # top 8 bits
    assert stats.chisquare(counts).pvalue > 1e-6  # uniform; fresh keys: fails 1 in 10^6 by chance
    plain_counts = np.bincount((plain >> np.uint64(24)).astype(np.int64), minlength=256)
    assert stats.chisquare(plain_counts).pvalue < 1e-6  # the unmasked update is far from uniform


def test_tampered_share_ciphertext_is_rejected() -> None:
    n = 5
    _, xs, q, parties, server = _setup(n)

    def flip(stage: str, cid: int, req: dict) -> dict:
        if stage == "masked_input" and cid == 1:
            src = next(iter(req["ciphertexts"]))
            blob = bytearray(req["ciphertexts"][src])
            blob[20] ^= 0x01
            req = {**req, "ciphertexts": {**req["ciphertexts"], src: bytes(blob)}}
        return req

    parties.tamper = flip
    total = secure_sum(server, parties)  # client 1 refuses the round; the others carry on
    assert "failed authentication" in parties.rejected[1]
    want = sum(xs[c] for c in range(n) if c != 1)
    np.testing.assert_allclose(q.decode_sum(total), want, atol=q.max_error(n), rtol=0)


@pytest.mark.parametrize(("prg", "bits"), [("chacha20", 32), ("aes-ctr", 20), ("chacha20", 17)])
def test_sum_with_either_prg_and_a_smaller_ring(prg: str, bits: int) -> None:
    n, dim = 9, 500
    cfg = SecureAggregationConfig(enabled=True, prg=prg, bits=bits)
    rng = np.random.default_rng(bits)
    xs = {c: rng.uniform(-1, 1, dim) for c in range(n)}
    parties = LocalParties(cfg, lambda cid, n1: Quantizer(bits, cfg.clip, n1).encode(xs[cid]))
    parties.trained(1, range(n))
    parties.drops[(1, "masked_input")] = {7, 8}  # the server rebuilds their pairwise masks
    total = secure_sum(SecAggServer(1, cfg, list(range(n)), dim, seed=5), parties)
    assert total.dtype == np.uint32 and int(total.max()) < 2**bits
    q = Quantizer(bits, cfg.clip, n)
    np.testing.assert_allclose(q.decode_sum(total), sum(xs[c] for c in range(7)), atol=q.max_error(n), rtol=0)


def test_corrupt_revealed_share_aborts_the_round_cleanly() -> None:
    n = 6
    _, _, _, parties, server = _setup(n)

    orig = server.finish

    def tampered(replies):  # every survivor's share of client 0's self-mask seed is garbage
        for r in replies.values():
            r["b_shares"] = {**r["b_shares"], 0: b"\xff" * 33}
        return orig(replies)

    server.finish = tampered  # type: ignore[method-assign]
    with pytest.raises(RoundAborted, match="client 0's self-mask seed cannot be rebuilt"):
        secure_sum(server, parties)


def test_broadcast_packed_once_and_per_client_requests_kept_apart() -> None:
    cfg = SecureAggregationConfig(enabled=True)
    seen: dict[int, dict] = {}

    class Spy(LocalParties):
        def deliver(self, stage, rnd, blobs):
            seen.update({c: unpack(b)[2] for c, b in blobs.items()})
            return {}

    spy = Spy(cfg, lambda cid, n1: np.zeros(1, np.uint32))
    shared = {"u3": [0, 1, 2]}
    spy.exchange("unmask", 1, dict.fromkeys(range(3), shared))
    assert all(seen[c] == shared for c in range(3))
    spy.tamper = lambda stage, cid, req: {"u3": [cid]}  # a fresh object per client, freed after packing
    spy.exchange("unmask", 1, dict.fromkeys(range(50), shared))
    assert all(seen[c] == {"u3": [c]} for c in range(50))


def test_client_with_malformed_public_keys_is_left_out() -> None:
    n = 6
    _, xs, q, parties, server = _setup(n)
    orig = server.share_keys_requests

    def garble(replies):
        replies[5] = {**replies[5], "s_pk": b"short"}
        return orig(replies)

    server.share_keys_requests = garble  # type: ignore[method-assign]
    total = secure_sum(server, parties)
    assert sorted(server.keys) == [0, 1, 2, 3, 4]
    q = Quantizer(32, 1.0, 5)  # clients scale by the round's advertised count
    np.testing.assert_allclose(q.decode_sum(total), sum(xs[c] for c in range(5)), atol=q.max_error(5), rtol=0)


def test_sealed_shares_routed_only_between_neighbours_still_in_the_round() -> None:
    # Prepare: secagg+ with k = 2 over 6 clients; the server has their keys.
    cfg = SecureAggregationConfig(enabled=True, mode="secagg+", neighbours=2)
    server = SecAggServer(1, cfg, list(range(6)), 4, seed=3)
    server.advertise_requests()
    keys = {u: {"c_pk": bytes([u]) * 32, "s_pk": bytes([u + 10]) * 32} for u in range(6)}
    requests = server.share_keys_requests(keys)
    for u, req in requests.items():
        assert dict(req["keys"]) == {v: bytes([v]) * 32 + bytes([v + 10]) * 32 for v in server.graph[u]}
    # Execute: clients 0-2 seal a share for each neighbour; 3 also for a non-neighbour, 4 with
    # the wrong length (both left out, like drop-outs); 5 is gone.
    commit = b"c" * 32
    sealed = {
        u: {"ciphertexts": {v: bytes([u, v]) * 47 for v in server.graph[u]}, "b_commit": commit}
        for u in range(5)
    }
    sealed[3]["ciphertexts"][3] = bytes([3, 3]) * 47
    sealed[4]["ciphertexts"] = {v: b"short" for v in server.graph[4]}
    routed = server.masked_input_requests(sealed)
    # Assert: each client gets exactly its neighbours' shares addressed to it.
    assert sorted(routed) == server.u2 == [0, 1, 2]
    assert set(server.rejected) == {3, 4}
    for v, req in routed.items():
        want = [u for u in server.graph[v] if u < 3]
        assert dict(req["ciphertexts"]) == {u: bytes([u, v]) * 47 for u in want}
