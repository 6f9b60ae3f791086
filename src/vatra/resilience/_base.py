"""``StoreBackend``: where checkpoint bytes live (a directory, S3, erasure-coded shards), by name."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from vatra.errors import VatraError


class StoreError(VatraError):
    """A checkpoint store could not be read or written (missing key, corrupt data, unreachable backend)."""


class StoreBackend:
    """Flat key → bytes storage with ``/``-separated keys.

    Call order: any mix of ``put``/``get``/``exists``/``delete``/``list``. ``put`` must be atomic for
    readers (a reader sees the old bytes, the new bytes, or no key — never a partial write) where the
    medium allows; the store above checks sha256 checksums on every read anyway, so a torn write is
    detected, not trusted. Backends are used from the training thread and one background upload
    thread, never concurrently on the same key.
    """

    registry: ClassVar[dict[str, type[StoreBackend]]] = {}
    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            StoreBackend.registry[cls.name] = cls

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def put_file(self, key: str, path: Path) -> None:
        """Store a local file's contents under ``key``; the file may be consumed (moved) by it."""
        self.put(key, path.read_bytes())

    def get(self, key: str) -> bytes:
        """The bytes under ``key``; raises :class:`StoreError` when absent or unreadable."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove ``key``; no error when it is already gone."""
        raise NotImplementedError

    def keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a folder such as ``"versions/"``), sorted."""
        raise NotImplementedError

    def repair(self, key: str) -> list[str]:
        """Rewrite damaged redundant copies of ``key``; returns what was repaired (default: nothing)."""
        return []

    def describe(self) -> str:
        return self.name
