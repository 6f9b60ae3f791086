"""Erasure-coded store backend: every object split by zfec into m shards over m locations; any k restore it.

Shard layout (one file per node under the same key)::

    magic "VSH2" | u8 k | u8 m | u8 index | u64 object size | 32-byte sha256 of the object
    | u64 generation time (ns) | u64 generation nonce | 32-byte sha256 of the payload | payload

The payload checksum lets a read skip a damaged shard instead of decoding garbage. The object
digest lets it decode only from k shards of one content: a node that missed a rewrite of
``tags/latest`` keeps the old shard, and combining it with new ones would produce bytes nobody
wrote. Shards of two writes of the same bytes are the same bytes (zfec is deterministic), so they
combine; the generation (one per write) orders contents, newest first. Storage overhead is m/k
(1.5× for k=4, m=6).

Every node call runs under a deadline (``store.erasure.timeout_s``): a node that raises or hangs
counts as unreachable (and is skipped for ``RETRY_AFTER_S``), and reads, writes, ``exists`` and
``delete`` go on with up to m − k of them, ``keys`` with up to min(m − k, k − 1). A key deleted
while a node was unreachable leaves a tombstone (``.deleted/<key>``, the delete's generation) on
the others, so the node's stale shard does not bring the key back when it returns; ``sweep``
removes both once every node answers.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import zfec

from vatra.errors import ConfigError
from vatra.resilience._base import MissingKey, StoreBackend, StoreError
from vatra.resilience.fsspec_backend import FsspecBackend

if TYPE_CHECKING:
    from vatra.config import StoreConfig

T = TypeVar("T")
Generation = tuple[int, int]  # (wall-clock ns, random nonce): ordered by time, distinct per write

_HEADER = struct.Struct(">4sBBBQ32sQQ32s")
_MAGIC, _OLD_MAGIC = b"VSH2", b"VSHD"
TOMBSTONES = ".deleted/"
RETRY_AFTER_S = 10.0  # a node that failed a call is skipped this long
_last_time_ns = 0
_gen_lock = threading.Lock()


def new_generation() -> Generation:
    """A generation newer than any this process made before, and distinct from any other write's.

    "Newest" is what a read prefers among groups of ≥ k shards, so the time must grow for
    successive writes of one key. The run lock makes one process the writer of a run's tags, and
    within it ``max(time_ns, last + 1)`` grows even when the wall clock steps back; across a
    restart only the wall clock orders writes, which NTP keeps within milliseconds while a restart
    takes seconds. The random nonce keeps two writes in the same nanosecond (two processes) apart,
    so their shards are never grouped together.
    """
    global _last_time_ns
    with _gen_lock:
        _last_time_ns = max(time.time_ns(), _last_time_ns + 1)
        return _last_time_ns, secrets.randbits(64)


@dataclass(frozen=True)
class Shard:
    k: int
    m: int
    index: int
    size: int  # of the whole object
    digest: bytes  # sha256 of the whole object
    generation: Generation
    payload: bytes


def encode(data: bytes, k: int, m: int, generation: Generation | None = None) -> list[bytes]:
    """m shards (header + payload) of ``data``; shards 0..k-1 hold the data itself, k..m-1 parity."""
    size = len(data)
    gen = generation or new_generation()
    digest = hashlib.sha256(data).digest()
    block = max(1, -(-size // k))  # ceil; zfec needs non-empty blocks
    padded = data + b"\0" * (block * k - size)
    primary = [padded[i * block : (i + 1) * block] for i in range(k)]
    blocks = zfec.Encoder(k, m).encode(primary)  # m blocks of `block` bytes
    return [
        _HEADER.pack(_MAGIC, k, m, i, size, digest, *gen, hashlib.sha256(b).digest()) + bytes(b)
        for i, b in enumerate(blocks)
    ]


def parse_shard(raw: bytes) -> Shard:
    """The shard in ``raw``; raises :class:`StoreError` saying what is wrong with it."""
    if raw[:4] == _OLD_MAGIC:
        raise StoreError(
            "shard in the old format (no object digest or generation); this vatra reads only stores "
            "it wrote, so write the checkpoints again"
        )
    if len(raw) < _HEADER.size or raw[:4] != _MAGIC:
        raise StoreError("not a shard (bad header)")
    _, k, m, index, size, digest, gen_ns, nonce, payload_sha = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size :]
    if hashlib.sha256(payload).digest() != payload_sha:
        raise StoreError("shard checksum mismatch (corrupt)")
    return Shard(k, m, index, size, digest, (gen_ns, nonce), payload)


def decode(shards: dict[int, bytes], k: int, m: int, size: int) -> bytes:
    """The object from any k intact payloads of one write, keyed by shard index."""
    nums = sorted(shards)[:k]
    # zfec wants primary blocks at their own position; sorted indices satisfy that
    blocks = zfec.Decoder(k, m).decode([shards[i] for i in nums], nums)
    return b"".join(blocks)[:size]


@dataclass
class _Read:
    """One key's shards on every node, grouped by write."""

    groups: dict[tuple[bytes, int], dict[int, Shard]]  # (object digest, size) → index → shard
    missing: list[int]
    corrupt: dict[int, str]
    unreachable: dict[int, str]

    def ranked(self, k: int) -> list[dict[int, Shard]]:
        """Groups of at least k shards, the newest write first."""
        full = [g for g in self.groups.values() if len(g) >= k]
        return sorted(full, key=newest, reverse=True)

    def newest(self) -> Generation:
        """The newest generation of any shard read (0, 0 without one)."""
        return max((newest(g) for g in self.groups.values()), default=(0, 0))


def newest(group: dict[int, Shard]) -> Generation:
    return max(s.generation for s in group.values())


class ErasureBackend(StoreBackend):
    """k-of-m erasure coding over m locations: directories or URLs (:class:`FsspecBackend`), or backends.

    Built from ``[store.erasure]`` (k, m, nodes, timeout_s) and ``store.options``; ``store.url`` is
    not used. Calls to the nodes run in parallel, each under ``timeout_s``; a node that failed is
    skipped for a few seconds, and one still busy with a call that timed out until that call ends,
    so a lost node costs one failure or one timeout now and then, not one per call.
    """

    def __init__(
        self,
        k: int,
        m: int,
        nodes: Sequence[str | StoreBackend],
        options: dict[str, Any] | None = None,
        *,
        timeout_s: float = 120.0,
    ) -> None:
        if not 1 <= k < m or len(nodes) != m:
            raise StoreError(f"erasure: need 1 ≤ k < m and m nodes (k={k}, m={m}, {len(nodes)} nodes)")
        self.k, self.m, self.timeout_s = k, m, timeout_s
        self.nodes = [n if isinstance(n, StoreBackend) else FsspecBackend(n, options) for n in nodes]
        # per node (by identity): a call that timed out and its start; the last failure and until when
        self._stuck: dict[StoreBackend, tuple[threading.Thread, float]] = {}
        self._failed: dict[StoreBackend, tuple[float, str]] = {}

    @classmethod
    def from_config(cls, cfg: StoreConfig, url: str) -> StoreBackend:
        if cfg.erasure is None:
            raise ConfigError(
                "store.backend: the erasure backend needs a [store.erasure] section (k, m, nodes)"
            )
        e = cfg.erasure
        return cls(e.k, e.m, e.nodes, cfg.options, timeout_s=e.timeout_s)

    # ------------------------------------------------------------ node calls
    def _node(self, i: int) -> str:
        return f"node {i} ({self.nodes[i].describe()})"

    def _fanout(
        self, call: Callable[[int], T], only: Sequence[int] | None = None
    ) -> dict[int, T | StoreError]:
        """``call(i)`` for every node (or ``only`` those) in parallel: index → result or error.

        A node that failed is not asked again for ``RETRY_AFTER_S`` (a call to a refusing endpoint
        costs its client's retries, ~1 s with s3fs's defaults, on every call otherwise), and a node
        still busy with a call that timed out is not asked until that call ends.
        """
        out: dict[int, T | StoreError] = {}
        running: dict[int, tuple[threading.Thread, list[Any]]] = {}
        now = time.monotonic()
        for i in range(self.m) if only is None else only:
            node = self.nodes[i]
            stuck = self._stuck.get(node)
            if stuck is not None and stuck[0].is_alive():
                out[i] = StoreError(
                    f"{self._node(i)}: still no answer to a call made {now - stuck[1]:.0f} s ago"
                )
                continue
            until, why = self._failed.get(node, (0.0, ""))
            if now < until:
                out[i] = StoreError(f"{why} (not asked again for {until - now:.0f} s)")
                continue
            box: list[Any] = []
            thread = threading.Thread(target=self._run, args=(call, i, box), daemon=True)
            thread.start()
            running[i] = (thread, box)
        for i, (thread, box) in running.items():
            node = self.nodes[i]
            thread.join(max(0.0, now + self.timeout_s - time.monotonic()))
            if thread.is_alive():
                self._stuck[node] = (thread, now)
                out[i] = StoreError(f"{self._node(i)}: no answer within {self.timeout_s:g} s")
            else:
                out[i] = box[0]
            if isinstance(out[i], StoreError) and not isinstance(out[i], MissingKey):
                self._failed[node] = (time.monotonic() + RETRY_AFTER_S, str(out[i]))
            else:
                self._failed.pop(node, None)
        return dict(sorted(out.items()))

    def _run(self, call: Callable[[int], Any], i: int, box: list[Any]) -> None:
        try:
            box.append(call(i))
        except MissingKey as err:
            box.append(err)
        except StoreError as err:
            box.append(StoreError(f"node {i}: {err}"))
        except Exception as err:  # a node's client library failing (connection refused, DNS, ...)
            box.append(StoreError(f"{self._node(i)}: {type(err).__name__}: {err}"))

    def _errors(self, results: dict[int, Any]) -> dict[int, StoreError]:
        return {i: r for i, r in results.items() if isinstance(r, StoreError)}

    def _require(self, what: str, errors: dict[int, StoreError], most: int | None = None) -> None:
        """Raise when more nodes failed than ``most`` (default m − k) allows."""
        most = self.m - self.k if most is None else most
        if len(errors) > most:
            first = next(iter(errors.values()))
            raise StoreError(f"{what}: {len(errors)} of {self.m} nodes failed, at most {most} may: {first}")

    # ---------------------------------------------------------------- reads
    def _read(self, key: str) -> _Read:
        read = _Read({}, [], {}, {})
        for i, raw in self._fanout(lambda i: self.nodes[i].get(key)).items():
            if isinstance(raw, MissingKey):
                read.missing.append(i)
            elif isinstance(raw, StoreError):
                read.unreachable[i] = str(raw)
            else:
                try:
                    shard = parse_shard(raw)
                    if (shard.k, shard.m, shard.index) != (self.k, self.m, i):
                        raise StoreError(
                            f"shard {shard.index} of a k={shard.k}, m={shard.m} code on node {i}"
                        )
                except StoreError as err:
                    read.corrupt[i] = str(err)
                    continue
                # one group per content, not per write: zfec's shards of the same bytes are the same
                # bytes, so two writes of one object (two ranks saving identical files) combine
                read.groups.setdefault((shard.digest, shard.size), {})[i] = shard
        return read

    def _restore(self, key: str, read: _Read) -> tuple[bytes, dict[int, Shard]]:
        """The newest write with k intact shards that decodes to its digest, and its shards."""
        for group in read.ranked(self.k):
            first = next(iter(group.values()))
            block = max(1, -(-first.size // self.k))
            if any(len(s.payload) != block for s in group.values()):
                continue  # headers that disagree with their payloads: not a write this code made
            data = decode({i: s.payload for i, s in group.items()}, self.k, self.m, first.size)
            if hashlib.sha256(data).digest() == first.digest:
                return data, group
        if not read.groups and not read.corrupt and len(read.missing) > self.m - self.k:
            raise MissingKey(f"{key}: missing on {len(read.missing)} of {self.m} nodes")
        largest = max(read.groups.values(), key=len, default={})
        best = len(largest)
        details = [
            f"{label} on nodes {nodes}"
            for label, nodes in (
                ("missing", read.missing),
                ("corrupt", sorted(read.corrupt)),
                ("unreachable", sorted(read.unreachable)),
                ("from other writes", sorted(i for g in read.groups.values() if g is not largest for i in g)),
            )
            if nodes
        ]
        raise StoreError(
            f"{key}: only {best} of {self.m} shards intact, {self.k} needed ({'; '.join(details)}); "
            "the object cannot be restored"
        )

    def get(self, key: str) -> bytes:
        return self._restore(key, self._read(key))[0]

    def exists(self, key: str) -> bool:
        """True when every reachable node (at least k) holds a shard of ``key``.

        ``put_object`` writes only what does not exist; so a key short of a shard on a node that
        answers (it was down during the write, or lost the file) reads as absent and is written
        again whole, instead of staying one loss closer to unreadable. A node that does not answer
        cannot say, and is repaired by ``vatra ckpt verify --repair`` once it is back.
        """
        results = self._fanout(lambda i: self.nodes[i].exists(key))
        self._require(f"exists {key}", self._errors(results))
        return all(r is True for r in results.values() if not isinstance(r, StoreError))

    def keys(self, prefix: str) -> list[str]:
        """Keys with a shard on any node, less those deleted while a node was away (tombstoned).

        Raises when so many nodes fail to answer that a key written to just k of them could be
        missing from the listing (more than m − k, or k or more): ``gc`` must never take an
        incomplete listing for the truth.
        """

        def listing(i: int) -> tuple[list[str], list[str]]:
            node = self.nodes[i]
            return node.keys(prefix), node.keys(TOMBSTONES + prefix)

        results = self._fanout(listing)
        errors = self._errors(results)
        self._require(f"list {prefix}", errors, min(self.m - self.k, self.k - 1))
        found: set[str] = set()
        buried: set[str] = set()
        for result in results.values():
            if not isinstance(result, StoreError):
                found.update(result[0])
                buried.update(k.removeprefix(TOMBSTONES) for k in result[1])
        return sorted(k for k in found if k not in buried or not self._dead(k))

    # --------------------------------------------------------------- writes
    def put(self, key: str, data: bytes) -> None:
        shards = encode(data, self.k, self.m)
        errors = self._errors(self._fanout(lambda i: self.nodes[i].put(key, shards[i])))
        if len(errors) > self.m - self.k:
            raise StoreError(
                f"{key}: only {self.m - len(errors)} of {self.m} shards written, {self.k} needed: "
                f"{next(iter(errors.values()))}"
            )

    def delete(self, key: str) -> None:
        """Remove every shard; nodes that fail (up to m − k) get a tombstone on the others."""
        errors = self._errors(self._fanout(lambda i: self.nodes[i].delete(key)))
        self._require(f"delete {key}", errors)
        if errors:
            mark = b"%d %d" % new_generation()
            done = [i for i in range(self.m) if i not in errors]
            written = self._fanout(lambda i: self.nodes[i].put(TOMBSTONES + key, mark), done)
            if len(self._errors(written)) == len(done):
                raise StoreError(f"delete {key}: removed, but no node took the tombstone: {errors}")

    def _dead(self, key: str) -> bool:
        """Whether ``key`` was deleted after its newest shard was written (its tombstone is newer).

        With fewer than k nodes away (``keys`` refuses otherwise), a write after the delete has a
        shard on a node that answers, so the newest shard seen is the newest there is.
        """
        marks = self._fanout(lambda i: self.nodes[i].get(TOMBSTONES + key))
        buried = [tuple(map(int, r.split())) for r in marks.values() if isinstance(r, bytes)]
        read = self._read(key)
        if read.corrupt or not buried:
            return False  # cannot tell: keep listing it, so gc refuses and verify reports it
        return max(buried) > read.newest()

    def _delete_everywhere(self, key: str) -> None:
        """Delete ``key`` on every node; raises when any fails (used where a leftover must not stay)."""
        self._require(f"delete {key}", self._errors(self._fanout(lambda i: self.nodes[i].delete(key))), 0)

    def repair(self, key: str) -> list[str]:
        """Rewrite missing, corrupt and stale shards of ``key`` from the newest restorable write."""
        read = self._read(key)
        data, group = self._restore(key, read)
        bad = [i for i in range(self.m) if i not in group and i not in read.unreachable]
        shards = encode(data, self.k, self.m, newest(group))
        errors = self._errors(self._fanout(lambda i: self.nodes[i].put(key, shards[i]), bad))
        done = [f"{key}: rewrote shard {i} on {self.nodes[i].describe()}" for i in bad if i not in errors]
        left = {**read.unreachable, **{i: str(e) for i, e in errors.items()}}
        if left:
            raise StoreError(
                f"{key}: rewrote shards {[i for i in bad if i not in errors]}, but not on nodes "
                f"{sorted(left)}: {next(iter(left.values()))}"
            )
        return done

    def sweep(self, older_than_s: float) -> list[str]:
        """Every node's stale temporary files; then, when every node answers, deleted keys' leftovers."""
        removed: list[str] = []
        for result in self._fanout(lambda i: self.nodes[i].sweep(older_than_s)).values():
            if not isinstance(result, StoreError):
                removed += result
        listings = self._fanout(lambda i: self.nodes[i].keys(TOMBSTONES))
        if self._errors(listings):
            return removed  # a node away may still hold a deleted key's shard: keep the tombstones
        buried = sorted({k for r in listings.values() if isinstance(r, list) for k in r})
        for mark in buried:
            key = mark.removeprefix(TOMBSTONES)
            if self._dead(key):
                self._delete_everywhere(key)
                removed.append(key)
            self._delete_everywhere(mark)
        return removed

    def describe(self) -> str:
        return f"erasure k={self.k} m={self.m} over {', '.join(n.describe() for n in self.nodes)}"
