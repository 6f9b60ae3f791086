"""The four stages of Bonawitz et al. (CCS'17): their messages and the client's state machine.

::

    stage          server → client u                     client u → server
    advertise      round facts                           c_pk, s_pk (X25519)
    share_keys     neighbours' c_pk ‖ s_pk, t, n1         shares of b_u, s_sk_u sealed per neighbour; H(b_u)
    masked_input   ciphertexts addressed to u             y_u = q(x_u) + PRG(b_u) + Σ ±PRG(s_uv)  mod 2^bits
    unmask         U3 ∩ ({u} ∪ N(u)) (who sent y)         shares of b_v (v ∈ U3) or s_sk_v (v ∈ U2 ∖ U3)

The server keeps going while at least t clients answer each stage, then removes the self-masks of
the survivors and the pairwise masks of the drop-outs: a server that follows the protocol learns
Σ_u x_u and nothing else (``docs/privacy.md``: the threat model). With fewer than t it raises
:class:`RoundAborted` (the server: :mod:`vatra.federated.secagg.server`).

A client answers each stage once, in order, and checks every request against what it has seen:
t against its own minimum (:meth:`SecureAggregationConfig.threshold_for`), U2 as the senders of
the shares it received, U3 ⊆ U2 ∪ {u} with at least t members. A second ``unmask`` with another
U3 would hand the server both secrets of some client; it is refused, like any repeated or
out-of-order stage. The server checks each rebuilt secret against its owner's commitment H(b_v)
or public key s_pk_v; a failed check is decoded again (Berlekamp–Welch), which names the
holders whose shares are wrong. A malformed reply drops its sender, like a drop-out.

``secagg+`` (Bell et al., CCS'20) replaces "every other client" by the k neighbours of a random
k-regular graph (a circulant graph over a random permutation), so a client's cost grows with k,
not n. Messages are plain dicts (bytes, ints, numpy arrays), packed for the wire by
:mod:`vatra.federated.secagg.messages`; keys, sealed shares and revealed shares travel as
``{client id: fixed-length bytes}`` tables (:class:`BytesTable`: an id array and a byte matrix),
which the server routes and collects with array operations.

Mask arithmetic runs in uint32 with native wrap-around (mod 2^32, in place) and is reduced
mod 2^bits once at the end, which gives the same words since 2^bits divides 2^32. The last
``wide`` words of a vector (the FedAvg weight) are not reduced: they are summed mod 2^32 whatever
``bits`` is, so a total weight up to 2^32 − 1 never wraps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vatra.config import SecureAggregationConfig
from vatra.federated.secagg.crypto import (
    SECRET_BYTES,
    SHARE_BYTES,
    KeyAgreement,
    SecAggError,
    bytes_int,
    commitment,
    int_bytes,
    new_keypair,
    open_sealed,
    prg,
    seal,
    share,
)

STAGES = ("advertise", "share_keys", "masked_input", "unmask")
REPLY_FIELDS = {  # what a client's answer to each stage carries (or {"error": why} if it refuses)
    "advertise": ("c_pk", "s_pk"),
    "share_keys": ("ciphertexts", "b_commit"),
    "masked_input": ("y",),
    "unmask": ("b_shares", "s_shares"),
}
Msg = dict[str, Any]


class RoundAborted(RuntimeError):
    """Fewer than t clients remained at some stage: no sum this round."""


def neighbour_graph(clients: list[int], cfg: SecureAggregationConfig, seed: int) -> dict[int, list[int]]:
    """N(u) for every client: all others (full) or a random k-regular circulant graph (secagg+)."""
    n = len(clients)
    if cfg.holders_for(n) == n:
        return {u: [v for v in clients if v != u] for u in clients}
    k = cfg.neighbours  # even (validated): a circulant graph with offsets ±1 … ±k/2
    order = [clients[i] for i in np.random.default_rng(seed).permutation(n)]
    graph: dict[int, list[int]] = {}
    for i, u in enumerate(order):
        graph[u] = sorted({order[(i + d) % n] for d in range(-k // 2, k // 2 + 1) if d})
    return graph


@dataclass
class Quantizer:
    """Fixed point: x ∈ [−clip, clip] of each of at most ``clients`` clients → words mod 2^bits.

    Each client's words lie in [−s, s] with s = ⌊(2^(bits−1) − 1) / clients⌋ whole steps, so the
    signed sum of all clients stays within [−(2^(bits−1) − 1), 2^(bits−1) − 1] and never wraps
    (a scale of (2^(bits−1) − 1)/clients without the floor let round-to-nearest push each client
    past its share: two clients at +clip summed to −2·clip). ValueError if s < 1.
    """

    bits: int
    clip: float
    clients: int

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(
                f"{self.clients} clients leave less than one quantization step each in a {self.bits}-bit "
                "ring; raise secure_aggregation.bits or lower the clients per round"
            )

    @property
    def steps(self) -> int:
        """Whole quantization steps for a value of ``clip``: each client's share of the signed range."""
        return ((1 << (self.bits - 1)) - 1) // self.clients

    @property
    def scale(self) -> float:
        return self.steps / self.clip

    def encode(self, x: np.ndarray) -> np.ndarray:
        q = np.rint(np.clip(x.astype(np.float64), -self.clip, self.clip) * self.scale).astype(np.int64)
        return (q & ((1 << self.bits) - 1)).astype(np.uint32)  # two's complement mod 2^bits

    def decode_sum(self, words: np.ndarray) -> np.ndarray:
        shift = np.uint32(32 - self.bits)  # sign-extend the top bit of each bits-wide word
        signed = (np.asarray(words, dtype=np.uint32) << shift).view(np.int32) >> np.int32(shift)
        return signed.astype(np.float64) / self.scale

    def max_error(self, clients: int) -> float:
        """Worst absolute error of a decoded sum of ``clients`` vectors (round-to-nearest)."""
        return 0.5 * clients / self.scale


def pair_info(rnd: int, u: int, v: int, purpose: str) -> bytes:
    a, b = min(u, v), max(u, v)
    return f"vatra-secagg/{purpose}/round {rnd}/{a}-{b}".encode()


def commit_context(rnd: int, u: int) -> bytes:
    return f"vatra-secagg/b-commit/round {rnd}/client {u}".encode()


def _ids(value: Any) -> list[int]:
    """A list of client ids (ints, no duplicates), or TypeError/ValueError."""
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise TypeError("client ids must be a list of ints")
    if len(set(value)) != len(value):
        raise ValueError(f"duplicate client ids in {value}")
    return value


@dataclass
class SecAggClient:
    """One client's side of one round; holds its secrets, never shows them to the server.

    :meth:`answer` is the only entry: each stage once, in :data:`STAGES` order. A refused or
    malformed request ends the client's part in the round — every later request is refused.
    ``words`` is the update trained for this round: read once, at masked_input, then dropped.
    """

    cid: int
    rnd: int
    cfg: SecureAggregationConfig
    words: Callable[[int], np.ndarray] | None  # clients in the round n1 → words to mask (uint32)
    wide: int = 0  # trailing words masked mod 2^32, not mod 2^bits (the weight)
    step: int = 0  # stages answered or refused so far
    c_sk: bytes = b""
    s_sk: bytes = b""
    b_seed: bytes = b""
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # v → (c_pk, s_pk)
    c_ka: KeyAgreement | None = None
    s_ka: KeyAgreement | None = None
    t: int = 0
    n1: int = 0
    held: dict[int, tuple[int, int]] = field(default_factory=dict)  # v → (share of b_v, share of s_sk_v)
    u2: list[int] = field(default_factory=list)  # neighbours whose shares reached this client

    def answer(self, stage: str, req: Msg) -> Msg:
        """The reply to ``stage``; SecAggError if it is not the next stage or breaks the protocol."""
        expected = STAGES[self.step] if self.step < len(STAGES) else "nothing (its part is over)"
        if stage != expected:
            self.step = len(STAGES)
            raise SecAggError(
                f"client {self.cid}: {stage} request in round {self.rnd}, expected {expected}; refusing"
            )
        self.step += 1
        try:
            if not isinstance(req, dict):
                raise TypeError(f"a {type(req).__name__}, not a dict")
            if stage == "advertise":
                return self._advertise()
            if stage == "share_keys":
                return self._share_keys(req)
            if stage == "masked_input":
                return self._masked_input(req)
            return self._unmask(req)
        except SecAggError:
            self.step = len(STAGES)
            raise
        except (KeyError, TypeError, ValueError) as err:
            self.step = len(STAGES)
            raise SecAggError(f"client {self.cid}: malformed {stage} request ({err!r}); refusing") from None

    def _advertise(self) -> Msg:
        self.c_sk, c_pk = new_keypair()
        self.s_sk, s_pk = new_keypair()
        return {"c_pk": c_pk, "s_pk": s_pk}

    def _share_keys(self, req: Msg) -> Msg:
        roster = req["keys"]
        if not isinstance(roster, Mapping) or any(
            type(v) is not int or not isinstance(k, bytes) or len(k) != 64 for v, k in roster.items()
        ):
            raise SecAggError(f"client {self.cid}: malformed public keys in the roster")
        self.keys = {v: (k[:32], k[32:]) for v, k in roster.items()}
        if type(req["t"]) is not int or type(req["n1"]) is not int:
            raise TypeError("t and n1 must be ints")
        t, self.n1 = req["t"], req["n1"]
        if self.cid in self.keys:
            raise SecAggError(f"client {self.cid}: server listed the client among its own neighbours")
        pks = [k for pair in self.keys.values() for k in pair]
        if len(set(pks)) != len(pks):
            raise SecAggError(f"client {self.cid}: duplicate public keys in the roster")
        holders = sorted([*self.keys, self.cid])
        if len(holders) != self.cfg.holders_for(self.n1):
            raise SecAggError(
                f"client {self.cid}: {len(holders) - 1} neighbours in a round of {self.n1} clients, "
                f"expected {self.cfg.holders_for(self.n1) - 1}; refusing"
            )
        try:
            own = self.cfg.threshold_for(len(holders))
        except ValueError as err:
            raise SecAggError(f"client {self.cid}: {err}") from None
        if not own <= t <= len(holders):
            raise SecAggError(
                f"client {self.cid}: threshold t = {t} is outside [{own}, {len(holders)}] "
                f"(its own minimum for {len(holders)} share holders); refusing"
            )
        self.t = t
        self.b_seed = os.urandom(SECRET_BYTES)
        sb = share(self.b_seed, [h + 1 for h in holders], self.t)
        ss = share(self.s_sk, [h + 1 for h in holders], self.t)
        self.held = {self.cid: (sb[self.cid + 1], ss[self.cid + 1])}
        self.c_ka, self.s_ka = KeyAgreement(self.c_sk), KeyAgreement(self.s_sk)
        out = {}
        for v in self.keys:
            key = self.c_ka.derive(self.keys[v][0], pair_info(self.rnd, self.cid, v, "share"))
            plain = int_bytes(sb[v + 1]) + int_bytes(ss[v + 1])
            out[v] = seal(key, plain, f"{self.rnd}|{self.cid}|{v}".encode())
        return {"ciphertexts": out, "b_commit": commitment(self.b_seed, commit_context(self.rnd, self.cid))}

    def _masked_input(self, req: Msg) -> Msg:
        """Mask the quantized words; uint32 sums wrap mod 2^32 by themselves."""
        assert self.c_ka is not None and self.s_ka is not None  # share_keys came first (answer's order)
        sealed = req["ciphertexts"]
        if not isinstance(sealed, Mapping):
            raise TypeError("ciphertexts must be an id → bytes table")
        for u, blob in sealed.items():
            if u not in self.keys or not isinstance(blob, bytes):
                raise SecAggError(f"client {self.cid}: ciphertext from non-neighbour {u}")
            key = self.c_ka.derive(self.keys[u][0], pair_info(self.rnd, u, self.cid, "share"))
            plain = open_sealed(key, blob, f"{self.rnd}|{u}|{self.cid}".encode())
            self.held[u] = (bytes_int(plain[:SHARE_BYTES]), bytes_int(plain[SHARE_BYTES:]))
        self.u2 = sorted(sealed)  # U2 as this client knows it: authenticated senders
        if len(self.u2) + 1 < self.t:
            raise SecAggError(f"client {self.cid}: only {len(self.u2)} neighbours left, threshold {self.t}")
        words, self.words = self.words, None
        if words is None:
            raise SecAggError(f"client {self.cid}: no update to mask in round {self.rnd}")
        x = words(self.n1)
        kind, n = self.cfg.prg, x.size
        scratch = np.empty(n + 4, dtype=np.uint32)
        y = x.astype(np.uint32)  # a copy: masked in place, wrapping mod 2^32
        np.add(y, prg(self.b_seed, n, kind, out=scratch), out=y)
        for v in self.u2:
            seed = self.s_ka.derive(self.keys[v][1], pair_info(self.rnd, self.cid, v, "mask"))
            (np.add if self.cid < v else np.subtract)(y, prg(seed, n, kind, out=scratch), out=y)
        if self.cfg.bits < 32:
            y[: n - self.wide] &= np.uint32((1 << self.cfg.bits) - 1)
        return {"y": y}

    def _unmask(self, req: Msg) -> Msg:
        u3 = set(_ids(req["u3"]))
        if strangers := sorted(u3.difference(self.u2, [self.cid])):
            raise SecAggError(
                f"client {self.cid}: U3 names {strangers}, not in its U2 (the clients whose shares it "
                "received); refusing"
            )
        if self.cid not in u3:
            raise SecAggError(f"client {self.cid}: not in U3, nothing to reveal")
        if len(u3) < self.t:
            raise SecAggError(f"client {self.cid}: {len(u3)} survivors < threshold {self.t}; refusing")
        b_shares, s_shares = {}, {}
        for v, (sb, ss) in self.held.items():
            if v in u3:
                b_shares[v] = int_bytes(sb)  # v's input counts: reveal its self-mask share only
            else:
                s_shares[v] = int_bytes(ss)  # v ∈ U2 ∖ U3 left after masking set-up: its mask key share only
        return {"b_shares": b_shares, "s_shares": s_shares}
