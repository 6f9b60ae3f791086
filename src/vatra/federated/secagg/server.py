"""The server's side of a secure-aggregation round: routes messages, counts survivors, unmasks the sum.

It stays in the round while at least t clients answer each stage (:class:`RoundAborted` below),
leaves out every client whose reply is malformed, and checks each rebuilt secret against what its
owner published before using it: a survivor's commitment H(b), a drop-out's public key s_pk. A
secret that fails is decoded again (Berlekamp–Welch), which names the holders whose shares are
wrong; the secrets still failing are then rebuilt again without them. The stages themselves are
described in :mod:`vatra.federated.secagg.protocol`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vatra.config import SecureAggregationConfig
from vatra.errors import ConfigError
from vatra.federated.secagg.crypto import (
    PRIME,
    SEALED_BYTES,
    SHARE_BYTES,
    KeyAgreement,
    SecAggError,
    SecretError,
    commitment,
    decode_shares,
    prg,
    public_key,
    reconstruct_many,
)
from vatra.federated.secagg.messages import BytesTable
from vatra.federated.secagg.protocol import (
    REPLY_FIELDS,
    Msg,
    RoundAborted,
    commit_context,
    neighbour_graph,
    pair_info,
)
from vatra.federated.wire import WireError


@dataclass
class SecAggServer:
    """The server's side of one round: routes messages, counts survivors, unmasks the sum.

    A reply that is not a dict with the stage's fields (:data:`REPLY_FIELDS`) of the right types
    leaves its sender out, like a drop-out; ``rejected`` says why, and names the holders whose
    revealed shares were found wrong (their shares are ignored; their own inputs still count).
    """

    rnd: int
    cfg: SecureAggregationConfig
    clients: list[int]
    dim: int  # words per masked vector
    seed: int = 0
    wide: int = 0  # trailing words summed mod 2^32, not mod 2^bits (the weight): SecAggClient.wide
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    graph: dict[int, list[int]] = field(default_factory=dict)
    t: int = 0
    u2: list[int] = field(default_factory=list)
    commits: dict[int, bytes] = field(default_factory=dict)  # u ∈ U2 → H(b_u)
    edges: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # u · m + v for v ∈ N(u), sorted
    masked: dict[int, np.ndarray] = field(default_factory=dict)
    survivors: dict[str, int] = field(default_factory=dict)  # stage → clients that answered
    rejected: dict[int, str] = field(default_factory=dict)  # client → why it was left out or blamed

    def _need(self, stage: str, got: int) -> None:
        self.survivors[stage] = got
        if got < self.t:
            raise RoundAborted(f"round {self.rnd}: {got} client(s) answered {stage}, threshold t = {self.t}")

    def _reject(self, u: int, stage: str, reason: str) -> None:
        self.rejected[u] = f"{stage}: {reason}"

    def _bodies(self, stage: str, replies: dict[int, Msg], asked: Container[int]) -> dict[int, Msg]:
        """The replies of clients that were asked, that are dicts with the stage's fields."""
        fields = REPLY_FIELDS[stage]
        ok = {}
        for u, r in sorted(replies.items()):
            if u not in asked:
                continue
            if isinstance(r, dict) and all(f in r for f in fields):
                ok[u] = r
            else:
                self._reject(u, stage, f"malformed reply (not a dict with {', '.join(fields)})")
        return ok

    def advertise_requests(self) -> dict[int, Msg]:
        try:  # a configured t that is no majority of the holders is a config error, not an abort
            self.t = self.cfg.threshold_for(self.cfg.holders_for(len(self.clients)))
        except ValueError as err:
            raise ConfigError(f"round {self.rnd}: {err}") from None
        facts = {"round": self.rnd, "dim": self.dim}  # one object for all: packed once
        return {u: facts for u in self.clients}

    def share_keys_requests(self, replies: dict[int, Msg]) -> dict[int, Msg]:
        replies = self._bodies("advertise", replies, set(self.clients))
        for u, r in list(replies.items()):
            if not all(isinstance(r[k], bytes) and len(r[k]) == 32 for k in ("c_pk", "s_pk")):
                self._reject(u, "advertise", "public keys are not two 32-byte strings")
                del replies[u]
        # a key advertised twice (copied from another client, or used as both of one client's keys)
        # drops every client that sent it: clients refuse a roster with a repeated key
        owners = defaultdict(list)
        for u, r in replies.items():
            for k in (r["c_pk"], r["s_pk"]):
                owners[k].append(u)
        for shared in (sorted(set(us)) for us in owners.values() if len(us) > 1):
            for u in shared:
                self._reject(u, "advertise", f"a public key advertised twice (by client(s) {shared})")
                replies.pop(u, None)
        self._need("advertise", len(replies))
        self.keys = {u: (r["c_pk"], r["s_pk"]) for u, r in replies.items()}
        u1 = sorted(self.keys)
        self.graph = neighbour_graph(u1, self.cfg, self.seed)
        self.t = self.cfg.threshold_for(self.cfg.holders_for(len(u1)))  # ≤ n clients: still a majority
        keys = np.frombuffer(b"".join(c_pk + s_pk for c_pk, s_pk in (self.keys[u] for u in u1)), np.uint8)
        roster = BytesTable(np.array(u1, dtype=np.int64), keys.reshape(len(u1), 64))  # (n1, c_pk ‖ s_pk)
        rosters = {u: roster.take(self.graph[u]) for u in u1}
        self.edges = np.sort(np.concatenate([self._edge(np.int64(u), rosters[u].ids) for u in u1]))
        return {u: {"keys": rosters[u], "t": self.t, "n1": len(u1)} for u in u1}

    def masked_input_requests(self, replies: dict[int, Msg]) -> dict[int, Msg]:
        sent = {}
        for u, r in self._bodies("share_keys", replies, self.keys).items():
            table = _table(r["ciphertexts"], SEALED_BYTES)
            if table is None or not np.array_equal(np.sort(table.ids), self.graph[u]):
                # a missing share would leave a pairwise mask that its neighbour never adds
                self._reject(u, "share_keys", "sealed shares are not one per neighbour, of sealed length")
            elif not (isinstance(r["b_commit"], bytes) and len(r["b_commit"]) == 32):
                self._reject(u, "share_keys", "the commitment H(b) is not 32 bytes")
            else:
                sent[u] = table
                self.commits[u] = r["b_commit"]
        self._need("share_keys", len(sent))
        self.u2 = list(sent)
        u2 = np.array(self.u2, dtype=np.int64)
        sender, receiver, sealed = _entries(sent, u2)  # receivers still in the round
        lo, hi = np.searchsorted(receiver, u2, "left"), np.searchsorted(receiver, u2, "right")
        return {
            v: {"ciphertexts": BytesTable(sender[a:b], sealed[a:b])}
            for v, a, b in zip(self.u2, lo.tolist(), hi.tolist(), strict=True)
        }

    def unmask_requests(self, replies: dict[int, Msg]) -> dict[int, Msg]:
        mask = np.uint32((1 << self.cfg.bits) - 1)
        for u, r in self._bodies("masked_input", replies, set(self.u2)).items():
            y = r["y"]
            if (
                not isinstance(y, np.ndarray)
                or y.dtype != np.uint32
                or y.shape != (self.dim,)
                or (self.cfg.bits < 32 and (y[: self.dim - self.wide] > mask).any())
            ):
                self._reject(u, "masked_input", "malformed masked vector")  # counted as dropped after U2
                continue
            self.masked[u] = y
        self._need("masked_input", len(self.masked))
        u3 = sorted(self.masked)
        if self.cfg.holders_for(len(self.keys)) == len(self.keys):  # full graph: one U3 for all
            notice = {"u3": u3}  # one object: the channel packs a broadcast once
            return {u: notice for u in u3}
        return {u: {"u3": [w for w in sorted([u, *self.graph[u]]) if w in self.masked]} for u in u3}

    def finish(self, replies: dict[int, Msg]) -> np.ndarray:
        """Σ_{u∈U3} x_u mod 2^bits (the last ``wide`` words mod 2^32), from the survivors' shares;
        raises RoundAborted below t."""
        revealed: dict[str, dict[int, BytesTable]] = {"b_shares": {}, "s_shares": {}}
        for u, r in self._bodies("unmask", replies, self.masked).items():
            b, s = _table(r["b_shares"], SHARE_BYTES), _table(r["s_shares"], SHARE_BYTES)
            if b is None or s is None:
                self._reject(u, "unmask", "revealed shares are not id → share tables")
                continue
            revealed["b_shares"][u], revealed["s_shares"][u] = b, s
        self._need("unmask", len(revealed["b_shares"]))
        u3 = sorted(self.masked)
        # (holder, owner, share) of every share the server needs, sorted by owner, then holder:
        # the survivors' self-mask seeds and the drop-outs' mask keys
        gone = sorted(set(self.u2).difference(self.masked))
        parts = [
            _entries(revealed[kind], np.array(owners, dtype=np.int64))
            for kind, owners in (("b_shares", u3), ("s_shares", gone))
        ]
        holder, owner, rows = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
        held = (holder == owner) | np.isin(self._edge(holder, owner), self.edges)  # shares it was dealt
        holder, owner, rows = holder[held], owner[held], rows[held]
        order = np.lexsort((holder, owner))
        secrets = self._rebuild(holder[order], owner[order], rows[order])
        kind, n = self.cfg.prg, self.dim
        scratch = np.empty(n + 4, dtype=np.uint32)
        total = np.zeros(n, dtype=np.uint32)
        for y in self.masked.values():
            np.add(total, y, out=total)  # wraps mod 2^32
        for v in self.u2:
            if v in self.masked:
                np.subtract(total, prg(secrets[v], n, kind, out=scratch), out=total)
                continue
            ka = KeyAgreement(secrets[v])  # v's mask key, loaded once for all its neighbours
            for u in (w for w in self.graph[v] if w in self.masked):
                seed = ka.derive(self.keys[u][1], pair_info(self.rnd, u, v, "mask"))
                # u added +m when u < v, −m otherwise
                (np.subtract if u < v else np.add)(total, prg(seed, n, kind, out=scratch), out=total)
        if self.cfg.bits < 32:
            total[: n - self.wide] &= np.uint32((1 << self.cfg.bits) - 1)
        self.survivors["summed"] = len(u3)
        return total

    def _rebuild(self, holder: np.ndarray, owner: np.ndarray, rows: np.ndarray) -> dict[int, bytes]:
        """Every needed secret, from its shares sorted by (owner, holder), each checked before use.

        Fast path (:meth:`_fast_path`): each secret from its t lowest-id holders not found wrong.
        A secret that fails its check is decoded from all its shares (Berlekamp–Welch), without
        those of holders already found wrong; when that names a new wrong holder, the secrets
        still failing go back to the fast path without it. One lying holder thus costs one
        decode, not one per secret (a decode is O(h³) big-integer operations: ~0.4 s at h = 80).
        """
        u2 = np.array(self.u2, dtype=np.int64)
        lo, hi = np.searchsorted(owner, u2, "left"), np.searchsorted(owner, u2, "right")
        for v, a, b in zip(self.u2, lo.tolist(), hi.tolist(), strict=True):
            if b - a < self.t:
                raise RoundAborted(
                    f"round {self.rnd}: {b - a} share(s) of client {v}'s secret < t = {self.t}"
                )
        span = {v: (a, b) for v, a, b in zip(self.u2, lo.tolist(), hi.tolist(), strict=True)}
        secrets: dict[int, bytes] = {}
        wrong: set[int] = set()
        failed = self._fast_path(self.u2, span, holder, rows, wrong, secrets)
        while failed:
            v, blamed = failed.pop(0), len(wrong)
            a, b = span[v]
            secrets[v] = self._decode(v, holder[a:b].tolist(), rows[a:b], wrong)
            if len(wrong) > blamed and failed:  # leave the newly blamed out and try the fast path again
                failed = self._fast_path(failed, span, holder, rows, wrong, secrets)
        return secrets

    def _fast_path(
        self,
        owners: list[int],
        span: dict[int, tuple[int, int]],
        holder: np.ndarray,
        rows: np.ndarray,
        wrong: set[int],
        secrets: dict[int, bytes],
    ) -> list[int]:
        """Rebuild ``owners``' secrets from t shares each into ``secrets``; the owners that failed.

        Each secret uses its t holders of lowest id, leaving out ``wrong`` (holder u's share is the
        point x = u + 1); secrets with the same t holders (all of them in full mode) are rebuilt
        together. Fewer than t holders left, a share outside the field or a failed check: failed.
        """
        left_out = np.array(sorted(wrong), dtype=np.int64)
        groups: dict[tuple[int, ...], list[np.ndarray]] = defaultdict(list)
        members: dict[tuple[int, ...], list[int]] = defaultdict(list)
        failed: list[int] = []
        for v in owners:
            a, b = span[v]
            kept = np.flatnonzero(~np.isin(holder[a:b], left_out)) if wrong else np.arange(b - a)
            at = a + kept[: self.t]  # (≤ t,) rows of v's shares
            if len(at) < self.t:
                failed.append(v)
                continue
            xs = tuple((holder[at] + 1).tolist())
            groups[xs].append(at)
            members[xs].append(v)
        for xs, ats in groups.items():
            try:
                rebuilt = reconstruct_many(xs, rows[np.stack(ats)])  # rows[(m, t)]: (m, t, SHARE_BYTES)
            except SecretError:  # a share outside the field: decode each of these secrets
                failed += members[xs]
                continue
            for v, secret in zip(members[xs], rebuilt, strict=True):
                if self._matches(v, secret):
                    secrets[v] = secret
                else:
                    failed.append(v)
        return sorted(failed)

    def _matches(self, v: int, secret: bytes) -> bool:
        """Does v's rebuilt secret match what v published: H(b_v) (a survivor), s_pk_v (a drop-out)?"""
        if v in self.masked:
            return commitment(secret, commit_context(self.rnd, v)) == self.commits[v]
        return public_key(secret) == self.keys[v][1]

    def _decode(self, v: int, holders: list[int], rows: np.ndarray, wrong: set[int]) -> bytes:
        """v's secret by Berlekamp–Welch; the holders off the polynomial join ``wrong``; else RoundAborted."""
        what = f"client {v}'s {'self-mask seed' if v in self.masked else 'mask key'}"
        shares = {}
        for h, row in zip(holders, rows, strict=True):
            if h in wrong:
                continue
            y = int.from_bytes(row.tobytes(), "big")
            if y >= PRIME:
                wrong.add(h)
                self._reject(h, "unmask", f"revealed a share of {what} outside the Shamir field")
                continue
            shares[h + 1] = y
        try:
            secret, off = decode_shares(shares, self.t)
        except SecAggError as err:
            raise RoundAborted(
                f"round {self.rnd}: {what} cannot be rebuilt: {err} (holders found wrong: {sorted(wrong)})"
            ) from None
        for x in off:
            wrong.add(x - 1)
            self._reject(x - 1, "unmask", f"revealed a share of {what} off the sharing polynomial")
        if not self._matches(v, secret):
            raise RoundAborted(
                f"round {self.rnd}: {what} does not match what client {v} published "
                "(it dealt bad shares, or too many holders sent wrong ones)"
            )
        return secret

    def _edge(self, u: np.ndarray | np.int64, v: np.ndarray) -> np.ndarray:
        """A key per edge u → v, for the clients of this round (ids up to max(keys))."""
        return u * (max(self.keys) + 1) + v


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
