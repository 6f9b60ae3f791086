"""Erasure-coded store backend: every object split by zfec into m shards over m locations; any k restore it.

Shard layout (one file per node under the same key)::

    magic "VSHD" | u8 k | u8 m | u8 index | u64 object size | 32-byte sha256 of the payload | payload

The per-shard checksum lets a read skip a damaged shard instead of decoding garbage, and lets
``repair`` tell which shards to rewrite. Storage overhead is m/k (1.5× for k=4, m=6).
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING, Any

import zfec

from vatra.errors import ConfigError
from vatra.resilience._base import StoreBackend, StoreError
from vatra.resilience.fsspec_backend import FsspecBackend

if TYPE_CHECKING:
    from vatra.config import StoreConfig

_HEADER = struct.Struct(">4sBBBQ32s")
_MAGIC = b"VSHD"


def encode(data: bytes, k: int, m: int) -> list[bytes]:
    """m shards (header + payload) of ``data``; shards 0..k-1 hold the data itself, k..m-1 parity."""
    size = len(data)
    block = max(1, -(-size // k))  # ceil; zfec needs non-empty blocks
    padded = data + b"\0" * (block * k - size)
    primary = [padded[i * block : (i + 1) * block] for i in range(k)]
    blocks = zfec.Encoder(k, m).encode(primary)  # m blocks of `block` bytes
    return [
        _HEADER.pack(_MAGIC, k, m, i, size, hashlib.sha256(b).digest()) + bytes(b)
        for i, b in enumerate(blocks)
    ]


def parse_shard(raw: bytes) -> tuple[int, int, int, int, bytes] | None:
    """(k, m, index, size, payload) of an intact shard, None when the header or checksum is wrong."""
    if len(raw) < _HEADER.size:
        return None
    magic, k, m, index, size, digest = _HEADER.unpack_from(raw)
    payload = raw[_HEADER.size :]
    if magic != _MAGIC or hashlib.sha256(payload).digest() != digest:
        return None
    return k, m, index, size, payload


def decode(shards: dict[int, bytes], k: int, m: int, size: int) -> bytes:
    """The object from any k intact payloads keyed by shard index."""
    nums = sorted(shards)[:k]
    # zfec wants primary blocks at their own position; sorted indices satisfy that
    blocks = zfec.Decoder(k, m).decode([shards[i] for i in nums], nums)
    return b"".join(blocks)[:size]


class ErasureBackend(StoreBackend):
    """k-of-m erasure coding over m :class:`FsspecBackend` locations (directories or URLs).

    Built from ``[store.erasure]`` (k, m, nodes) and ``store.options``; ``store.url`` is not used.
    """

    def __init__(self, k: int, m: int, nodes: list[str], options: dict[str, Any] | None = None) -> None:
        if not 1 <= k < m or len(nodes) != m:
            raise StoreError(f"erasure: need 1 ≤ k < m and m nodes (k={k}, m={m}, {len(nodes)} nodes)")
        self.k, self.m = k, m
        self.nodes = [FsspecBackend(n, options) for n in nodes]

    @classmethod
    def from_config(cls, cfg: StoreConfig, url: str) -> StoreBackend:
        if cfg.erasure is None:
            raise ConfigError(
                "store.backend: the erasure backend needs a [store.erasure] section (k, m, nodes)"
            )
        e = cfg.erasure
        return cls(e.k, e.m, e.nodes, cfg.options)

    def put(self, key: str, data: bytes) -> None:
        failed = []
        for node, shard in zip(self.nodes, encode(data, self.k, self.m), strict=True):
            try:
                node.put(key, shard)
            except StoreError as err:
                failed.append(str(err))
        if len(failed) > self.m - self.k:
            raise StoreError(f"{key}: only {self.m - len(failed)} of {self.m} shards written: {failed[0]}")

    def _read_shards(self, key: str) -> tuple[dict[int, bytes], int | None, list[int]]:
        """Intact payloads by index, the object size, and the indices of missing or damaged shards."""
        good: dict[int, bytes] = {}
        size: int | None = None
        bad: list[int] = []
        for i, node in enumerate(self.nodes):
            try:
                parsed = parse_shard(node.get(key))
            except StoreError:
                parsed = None
            if parsed is None or parsed[:3] != (self.k, self.m, i):
                bad.append(i)
                continue
            good[i], size = parsed[4], parsed[3]
        return good, size, bad

    def get(self, key: str) -> bytes:
        good, size, bad = self._read_shards(key)
        if len(good) < self.k or size is None:
            raise StoreError(
                f"{key}: only {len(good)} of {self.m} shards intact, {self.k} needed "
                f"(missing or corrupt on nodes {bad}); the object cannot be restored"
            )
        return decode(good, self.k, self.m, size)

    def exists(self, key: str) -> bool:
        return sum(node.exists(key) for node in self.nodes) >= self.k

    def delete(self, key: str) -> None:
        for node in self.nodes:
            node.delete(key)

    def keys(self, prefix: str) -> list[str]:
        """Keys with at least one shard on any node (a key short of k shards fails on read, loudly)."""
        keys: set[str] = set()
        for node in self.nodes:
            try:
                keys.update(node.keys(prefix))
            except StoreError:
                continue
        return sorted(keys)

    def repair(self, key: str) -> list[str]:
        _, _, bad = self._read_shards(key)
        if not bad:
            return []
        data = self.get(key)  # raises when fewer than k shards survive
        shards = encode(data, self.k, self.m)
        for i in bad:
            self.nodes[i].put(key, shards[i])
        return [f"{key}: rewrote shard {i} on {self.nodes[i].url}" for i in bad]

    def describe(self) -> str:
        return f"erasure k={self.k} m={self.m} over {', '.join(n.url for n in self.nodes)}"
