"""The four stages of Bonawitz et al. (CCS'17), as a client and a server state machine.

::

    stage          server → client u                     client u → server
    advertise      round facts                           c_pk, s_pk (X25519)
    share_keys     neighbours' c_pk ‖ s_pk, t             Shamir shares of b_u, s_sk_u, sealed per neighbour
    masked_input   ciphertexts addressed to u, U2 ∩ N(u)  y_u = q(x_u) + PRG(b_u) + Σ ±PRG(s_uv)  mod 2^bits
    unmask         U3 (who sent y)                       shares of b_v (v ∈ U3) or s_sk_v (v ∉ U3, v ∈ U2)

The server keeps going while at least t clients answer each stage, then removes the self-masks of
the survivors and the pairwise masks of the drop-outs: it learns Σ_u x_u and nothing else. With
fewer than t it raises :class:`RoundAborted`. ``secagg+`` (Bell et al., CCS'20) replaces "every
other client" by the k neighbours of a random k-regular graph (a circulant graph over a random
permutation), so a client's cost grows with k, not n. Messages are plain dicts (bytes, ints,
numpy arrays), packed for the wire by :mod:`vatra.federated.secagg.messages`; keys, sealed shares
and revealed shares travel as ``{client id: fixed-length bytes}`` tables (:class:`BytesTable`: an
id array and a byte matrix), which the server routes and collects with array operations.

Mask arithmetic runs in uint32 with native wrap-around (mod 2^32, in place) and is reduced
mod 2^bits once at the end, which gives the same words since 2^bits divides 2^32.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vatra.config import SecureAggregationConfig
from vatra.federated.secagg.crypto import (
    SEALED_BYTES,
    SECRET_BYTES,
    SHARE_BYTES,
    KeyAgreement,
    SecAggError,
    SecretError,
    bytes_int,
    int_bytes,
    new_keypair,
    open_sealed,
    prg,
    reconstruct_many,
    seal,
    share,
)
from vatra.federated.secagg.messages import BytesTable
from vatra.federated.wire import WireError

STAGES = ("advertise", "share_keys", "masked_input", "unmask")
Msg = dict[str, Any]


class RoundAborted(RuntimeError):
    """Fewer than t clients remained at some stage: no sum this round."""


def threshold(cfg: SecureAggregationConfig, holders: int) -> int:
    """t for a secret shared among ``holders`` clients (n in full mode, k + 1 in secagg+)."""
    return cfg.threshold if cfg.threshold else math.ceil(2 * holders / 3)


def neighbour_graph(clients: list[int], cfg: SecureAggregationConfig, seed: int) -> dict[int, list[int]]:
    """N(u) for every client: all others (full) or a random k-regular circulant graph (secagg+)."""
    n = len(clients)
    k = min(cfg.neighbours, n - 1)
    if cfg.mode == "full" or k >= n - 1:
        return {u: [v for v in clients if v != u] for u in clients}
    k -= k % 2  # circulant k-regular graphs need an even k
    order = [clients[i] for i in np.random.default_rng(seed).permutation(n)]
    graph: dict[int, list[int]] = {}
    for i, u in enumerate(order):
        graph[u] = sorted({order[(i + d) % n] for d in range(-k // 2, k // 2 + 1) if d})
    return graph


@dataclass
class Quantizer:
    """Fixed point: x ∈ [−clip, clip] of each of at most ``clients`` clients → words mod 2^bits.

    The scale leaves one bit of headroom so the signed sum of all clients never wraps.
    """

    bits: int
    clip: float
    clients: int

    @property
    def scale(self) -> float:
        return float((1 << (self.bits - 1)) - 1) / (self.clients * self.clip)

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


def _info(rnd: int, u: int, v: int, purpose: str) -> bytes:
    a, b = min(u, v), max(u, v)
    return f"vatra-secagg/{purpose}/round {rnd}/{a}-{b}".encode()


@dataclass
class SecAggClient:
    """One client's side of one round; holds its secrets, never shows them to the server."""

    cid: int
    rnd: int
    cfg: SecureAggregationConfig
    c_sk: bytes = b""
    s_sk: bytes = b""
    b_seed: bytes = b""
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # v → (c_pk, s_pk)
    c_ka: KeyAgreement | None = None
    s_ka: KeyAgreement | None = None
    t: int = 0
    n1: int = 0
    held: dict[int, tuple[int, int]] = field(default_factory=dict)  # v → (share of b_v, share of s_sk_v)
    u2: list[int] = field(default_factory=list)

    def advertise(self, req: Msg) -> Msg:
        self.c_sk, c_pk = new_keypair()
        self.s_sk, s_pk = new_keypair()
        return {"c_pk": c_pk, "s_pk": s_pk}

    def share_keys(self, req: Msg) -> Msg:
        if any(not isinstance(k, bytes) or len(k) != 64 for k in req["keys"].values()):
            raise SecAggError(f"client {self.cid}: malformed public keys in the roster")
        self.keys = {int(v): (k[:32], k[32:]) for v, k in req["keys"].items()}
        self.t, self.n1 = int(req["t"]), int(req["n1"])
        if self.cid in self.keys:
            raise SecAggError(f"client {self.cid}: server listed the client among its own neighbours")
        pks = [k for pair in self.keys.values() for k in pair]
        if len(set(pks)) != len(pks):
            raise SecAggError(f"client {self.cid}: duplicate public keys in the roster")
        holders = sorted([*self.keys, self.cid])
        if self.t > len(holders):
            raise SecAggError(f"client {self.cid}: threshold {self.t} > {len(holders)} share holders")
        self.b_seed = os.urandom(SECRET_BYTES)
        sb = share(self.b_seed, [h + 1 for h in holders], self.t)
        ss = share(self.s_sk, [h + 1 for h in holders], self.t)
        self.held = {self.cid: (sb[self.cid + 1], ss[self.cid + 1])}
        self.c_ka, self.s_ka = KeyAgreement(self.c_sk), KeyAgreement(self.s_sk)
        out = {}
        for v in self.keys:
            key = self.c_ka.derive(self.keys[v][0], _info(self.rnd, self.cid, v, "share"))
            plain = int_bytes(sb[v + 1]) + int_bytes(ss[v + 1])
            out[v] = seal(key, plain, f"{self.rnd}|{self.cid}|{v}".encode())
        return {"ciphertexts": out}

    def masked_input(self, req: Msg, x: np.ndarray) -> Msg:
        """Mask the quantized words ``x`` (uint32, < 2^bits); uint32 sums wrap mod 2^32 by themselves."""
        if self.c_ka is None or self.s_ka is None:
            raise SecAggError(f"client {self.cid}: masked_input before share_keys")
        for u, blob in req["ciphertexts"].items():
            u = int(u)
            if u not in self.keys:
                raise SecAggError(f"client {self.cid}: ciphertext from non-neighbour {u}")
            key = self.c_ka.derive(self.keys[u][0], _info(self.rnd, u, self.cid, "share"))
            plain = open_sealed(key, blob, f"{self.rnd}|{u}|{self.cid}".encode())
            self.held[u] = (bytes_int(plain[:SHARE_BYTES]), bytes_int(plain[SHARE_BYTES:]))
        self.u2 = sorted(int(v) for v in req["u2"])
        if len(self.u2) + 1 < self.t:
            raise SecAggError(f"client {self.cid}: only {len(self.u2)} neighbours left, threshold {self.t}")
        kind, n = self.cfg.prg, x.size
        scratch = np.empty(n + 4, dtype=np.uint32)
        y = x.astype(np.uint32)  # a copy: masked in place, wrapping mod 2^32
        np.add(y, prg(self.b_seed, n, kind, out=scratch), out=y)
        for v in self.u2:
            seed = self.s_ka.derive(self.keys[v][1], _info(self.rnd, self.cid, v, "mask"))
            (np.add if self.cid < v else np.subtract)(y, prg(seed, n, kind, out=scratch), out=y)
        if self.cfg.bits < 32:
            y &= np.uint32((1 << self.cfg.bits) - 1)
        return {"y": y}

    def unmask(self, req: Msg) -> Msg:
        u3 = {int(v) for v in req["u3"]}
        if len(u3) < self.t:
            raise SecAggError(f"client {self.cid}: {len(u3)} survivors < threshold {self.t}; refusing")
        if self.cid not in u3:
            raise SecAggError(f"client {self.cid}: not in U3, nothing to reveal")
        b_shares, s_shares = {}, {}
        for v, (sb, ss) in self.held.items():
            if v in u3:
                b_shares[v] = int_bytes(sb)  # v's input counts: reveal its self-mask share only
            elif v in self.u2:
                s_shares[v] = int_bytes(ss)  # v dropped after masking set-up: reveal its mask key share only
        return {"b_shares": b_shares, "s_shares": s_shares}


@dataclass
class SecAggServer:
    """The server's side of one round: routes messages, counts survivors, unmasks the sum."""

    rnd: int
    cfg: SecureAggregationConfig
    clients: list[int]
    dim: int  # words per masked vector
    seed: int = 0
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    graph: dict[int, list[int]] = field(default_factory=dict)
    t: int = 0
    u2: list[int] = field(default_factory=list)
    edges: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # u · m + v for v ∈ N(u), sorted
    masked: dict[int, np.ndarray] = field(default_factory=dict)
    survivors: dict[str, int] = field(default_factory=dict)  # stage → clients that answered

    def _need(self, stage: str, got: int) -> None:
        self.survivors[stage] = got
        if got < self.t:
            raise RoundAborted(f"round {self.rnd}: {got} client(s) answered {stage}, threshold t = {self.t}")

    def advertise_requests(self) -> dict[int, Msg]:
        full = neighbour_graph(self.clients, self.cfg, self.seed)
        self.t = threshold(self.cfg, len(next(iter(full.values()))) + 1)
        facts = {"round": self.rnd, "dim": self.dim}  # one object for all: packed once
        return {u: facts for u in self.clients}

    def share_keys_requests(self, replies: dict[int, Msg]) -> dict[int, Msg]:
        # a client whose public keys are not two 32-byte strings is left out, like a drop-out
        replies = {
            u: r
            for u, r in replies.items()
            if all(isinstance(r.get(k), bytes) and len(r[k]) == 32 for k in ("c_pk", "s_pk"))
        }
        self._need("advertise", len(replies))
        self.keys = {u: (r["c_pk"], r["s_pk"]) for u, r in replies.items()}
        u1 = sorted(self.keys)
        self.graph = neighbour_graph(u1, self.cfg, self.seed)
        self.t = threshold(self.cfg, len(next(iter(self.graph.values()))) + 1)
        keys = np.frombuffer(b"".join(c_pk + s_pk for c_pk, s_pk in (self.keys[u] for u in u1)), np.uint8)
        roster = BytesTable(np.array(u1, dtype=np.int64), keys.reshape(len(u1), 64))  # (n1, c_pk ‖ s_pk)
        rosters = {u: roster.take(self.graph[u]) for u in u1}
        self.edges = np.sort(np.concatenate([self._edge(np.int64(u), rosters[u].ids) for u in u1]))
        return {u: {"keys": rosters[u], "t": self.t, "n1": len(u1)} for u in u1}

    def masked_input_requests(self, replies: dict[int, Msg]) -> dict[int, Msg]:
        # a client whose sealed shares are not a table of sealed-share-long rows is left out, like a drop-out
        tables = {u: _table(r.get("ciphertexts"), SEALED_BYTES) for u, r in sorted(replies.items())}
        sent = {u: table for u, table in tables.items() if table is not None}
        self._need("share_keys", len(sent))
        self.u2 = list(sent)
        u2 = np.array(self.u2, dtype=np.int64)
        sender, receiver, sealed = _entries(sent, u2)  # receivers still in the round, so < m below
        ok = np.isin(self._edge(sender, receiver), self.edges)  # and neighbours of the sender
        sender, receiver, sealed = sender[ok], receiver[ok], sealed[ok]
        lo, hi = np.searchsorted(receiver, u2, "left"), np.searchsorted(receiver, u2, "right")
        return {
            v: {"ciphertexts": BytesTable(sender[a:b], sealed[a:b]), "u2": sender[a:b].tolist()}
            for v, a, b in zip(self.u2, lo.tolist(), hi.tolist(), strict=True)
        }

    def unmask_requests(self, replies: dict[int, Msg]) -> dict[int, Msg]:
        self._need("masked_input", len(replies))
        mask = np.uint32((1 << self.cfg.bits) - 1)
        for u, r in replies.items():
            y = np.asarray(r["y"])
            if y.dtype != np.uint32 or y.shape != (self.dim,) or (self.cfg.bits < 32 and (y > mask).any()):
                raise RoundAborted(f"round {self.rnd}: client {u} sent a malformed masked vector")
            self.masked[u] = y
        u3 = sorted(self.masked)
        notice = {"u3": u3}  # one object for all: the channel packs a broadcast once
        return {u: notice for u in u3}

    def finish(self, replies: dict[int, Msg]) -> np.ndarray:
        """Σ_{u∈U3} x_u mod 2^bits, from the survivors' shares; raises RoundAborted below t."""
        self._need("unmask", len(replies))
        u3 = sorted(self.masked)
        # (holder, owner, share) of every share the server needs, sorted by owner, then holder:
        # the survivors' self-mask seeds and the drop-outs' mask keys
        gone = sorted(set(self.u2).difference(self.masked))
        parts = [
            _entries(self._revealed(replies, kind), np.array(owners, dtype=np.int64))
            for kind, owners in (("b_shares", u3), ("s_shares", gone))
        ]
        holder, owner, rows = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
        order = np.lexsort((holder, owner))
        holder, owner, rows = holder[order], owner[order], rows[order]
        u2 = np.array(self.u2, dtype=np.int64)
        lo, hi = np.searchsorted(owner, u2, "left"), np.searchsorted(owner, u2, "right")
        for v, a, b in zip(self.u2, lo.tolist(), hi.tolist(), strict=True):
            if b - a < self.t:
                raise RoundAborted(
                    f"round {self.rnd}: {b - a} share(s) of client {v}'s secret < t = {self.t}"
                )
        # each secret from its t holders of lowest id (holder u's share is the point x = u + 1);
        # secrets with the same t holders (all of them in full mode) are rebuilt together
        start = dict(zip(self.u2, lo.tolist(), strict=True))
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for v, a in start.items():
            groups[tuple((holder[a : a + self.t] + 1).tolist())].append(v)
        secrets: dict[int, bytes] = {}
        for xs, owners in groups.items():
            at = np.array([start[v] for v in owners])[:, None] + np.arange(self.t)  # (m, t)
            try:
                secrets.update(zip(owners, reconstruct_many(xs, rows[at]), strict=True))
            except SecretError as err:
                raise RoundAborted(f"round {self.rnd}: client {owners[err.index]}'s secret: {err}") from None
            except SecAggError as err:
                raise RoundAborted(f"round {self.rnd}: the secrets of clients {owners}: {err}") from None
        kind, n = self.cfg.prg, self.dim
        scratch = np.empty(n + 4, dtype=np.uint32)
        total = np.zeros(n, dtype=np.uint32)
        for y in self.masked.values():
            np.add(total, y, out=total)  # wraps mod 2^32
        for v in self.u2:
            if v in self.masked:
                np.subtract(total, prg(secrets[v], n, kind, out=scratch), out=total)
                continue
            try:
                ka = KeyAgreement(secrets[v])  # v's mask key, loaded once for all its neighbours
            except ValueError as err:
                raise RoundAborted(f"round {self.rnd}: client {v}'s secret: {err}") from None
            for u in (w for w in self.graph[v] if w in self.masked):
                seed = ka.derive(self.keys[u][1], _info(self.rnd, u, v, "mask"))
                # u added +m when u < v, −m otherwise
                (np.subtract if u < v else np.add)(total, prg(seed, n, kind, out=scratch), out=total)
        if self.cfg.bits < 32:
            total &= np.uint32((1 << self.cfg.bits) - 1)
        self.survivors["summed"] = len(u3)
        return total

    def _edge(self, u: np.ndarray | np.int64, v: np.ndarray) -> np.ndarray:
        """A key per edge u → v, for the clients of this round (ids up to max(keys))."""
        return u * (max(self.keys) + 1) + v

    def _revealed(self, replies: dict[int, Msg], kind: str) -> dict[int, BytesTable]:
        """Each replying client's table of revealed shares of ``kind``; RoundAborted if one is malformed."""
        tables = {}
        for u, r in sorted(replies.items()):
            if (table := _table(r.get(kind, {}), SHARE_BYTES)) is None:
                raise RoundAborted(f"round {self.rnd}: client {u} sent malformed {kind}")
            tables[u] = table
        return tables


def _table(value: Any, width: int) -> BytesTable | None:
    """``value`` as a table of ``width``-byte entries ({} is an empty one), or None if it is not one."""
    try:
        table = BytesTable.from_dict(value)
    except WireError:
        return None
    if not len(table):
        return BytesTable(table.ids, np.zeros((0, width), np.uint8))
    return table if table.width == width else None


def _entries(tables: dict[int, BytesTable], wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """{u: {v: row}} → the arrays (u, v, row) of every entry whose v is in ``wanted``, sorted by v, then u."""
    src = np.repeat(np.array(list(tables), dtype=np.int64), [len(t) for t in tables.values()])  # (E,)
    dst = np.concatenate([t.ids for t in tables.values()])  # (E,)
    rows = np.concatenate([t.rows for t in tables.values()])  # (E, width)
    keep = np.flatnonzero(np.isin(dst, wanted))
    keep = keep[np.lexsort((src[keep], dst[keep]))]
    return src[keep], dst[keep], rows[keep]
