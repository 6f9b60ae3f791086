"""``StoreBackend``: where checkpoint bytes live (a directory, S3, erasure-coded shards)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from vatra.errors import ConfigError, VatraError

if TYPE_CHECKING:
    from vatra.config import StoreConfig


class StoreError(VatraError):
    """A checkpoint store could not be read or written (missing key, corrupt data, unreachable backend)."""


class MissingKey(StoreError):
    """The key is not in the store (as opposed to a store that could not be reached or read)."""


class StoreUsageError(StoreError, ConfigError):
    """A store command asked for something that makes no sense (``gc --keep 0``): exit code 2."""


class GcAborted(StoreError):
    """``gc`` found records it cannot read; it deletes nothing rather than guess what they reference."""


class StoreBackend:
    """Flat key → bytes storage with ``/``-separated keys.

    Call order: :meth:`from_config` once (``open_store``), then any mix of
    ``put``/``get``/``exists``/``delete``/``keys``, and ``sweep`` from ``gc``. ``put`` must be atomic
    for readers (a reader sees the old bytes, the new bytes, or no key — never a partial write) and
    durable once it returns, where the medium allows; the store above checks sha256 checksums on
    every read anyway, so a torn write is detected, not trusted. Failures are one-line
    :class:`StoreError` s (:class:`MissingKey` for an absent key). Backends are used from the
    training thread, background upload threads and every rank's process (each uploads its own
    files), never concurrently on the same key except for content-addressed objects, whose
    writers all write the same bytes.

    A user's subclass named by import string (``store.backend = "pkg.mod:MyBackend"``) works like a
    built-in: ``open_store`` constructs it as ``MyBackend(url, options)`` — ``store.url`` (or the
    run's ``checkpoints/`` folder when that is empty) and ``store.options`` — unless it overrides
    :meth:`from_config`.
    """

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        """The constructor :meth:`from_config` calls; subclasses define it (the base holds nothing)."""

    @classmethod
    def from_config(cls, cfg: StoreConfig, url: str) -> StoreBackend:
        """The backend for a ``store`` section; ``url`` is ``store.url`` or the default folder."""
        return cls(url, cfg.options)

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def put_file(self, key: str, path: Path) -> None:
        """Store a local file's contents under ``key``; the file may be consumed (moved) by it."""
        self.put(key, path.read_bytes())

    def get(self, key: str) -> bytes:
        """The bytes under ``key``; raises :class:`MissingKey` when absent, else :class:`StoreError`."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def create(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it is absent, atomically: True when this call created it, False when
        the key existed (another writer won). Two writers never both get True for one key, which is
        what an append-only log kept by several processes needs (the model registry's alias history).
        Backends that cannot promise it refuse with a :class:`StoreError` (the default)."""
        raise StoreError(
            f"{self.describe()}: this store backend cannot create a key only if it is absent; "
            "use a local folder or s3:// for the model registry"
        )

    def delete(self, key: str) -> None:
        """Remove ``key``; no error when it is already gone."""
        raise NotImplementedError

    def keys(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a folder such as ``"versions/"``), sorted."""
        raise NotImplementedError

    def repair(self, key: str) -> list[str]:
        """Rewrite damaged redundant copies of ``key``; returns what was repaired (default: nothing)."""
        return []

    def sweep(self, older_than_s: float) -> list[str]:
        """Remove leftovers of interrupted writes not touched for ``older_than_s`` seconds.

        Temporary files (``*.tmp-*``) of a write that died, shards of keys deleted while a node
        was down; returns what was removed (default: nothing). A write in progress keeps touching
        its temporary file, so an age of minutes never removes one that is still being written.
        """
        return []

    def describe(self) -> str:
        """Where the bytes live, for messages (default: the class as an import string)."""
        return f"{type(self).__module__}:{type(self).__qualname__}"
