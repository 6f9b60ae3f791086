"""A reusable test suite for checkpoint-store backends: any ``StoreBackend`` proves itself against it.

As Optuna ships its storage tests, a backend (built-in or a user's ``store.backend = "pkg.mod:B"``)
subclasses :class:`StoreBackendContract` in a pytest module and provides a ``backend`` fixture::

    from vatra.resilience.testing import StoreBackendContract

    class TestMyBackend(StoreBackendContract):
        @pytest.fixture
        def backend(self, tmp_path):
            return MyBackend(str(tmp_path / "store"))

Every test then runs on it: a version round trip with checksums, the fallback past a corrupt object,
rollback by moving ``latest``, garbage collection, content-addressed objects stored once, an
empty store, and create-if-absent (where the backend offers it: the model registry's alias
history). pytest is needed only to run the suite (``pip install vatra[dev]``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from vatra.resilience._base import StoreBackend, StoreError
from vatra.resilience.store import LAST_GOOD, LATEST, CheckpointStore


def _save(store: CheckpointStore, step: int, parent: str | None, payload: bytes) -> str:
    files: dict[str, bytes | Path] = {
        "model.bin": payload + step.to_bytes(4, "little"),
        "rank00000.pt": b"rank state %d" % step,
    }
    return str(
        store.write_version(files, step=step, parent=parent, world_size=1, tags=(LAST_GOOD,))["version"]
    )


def chain(store: CheckpointStore, steps: list[int]) -> list[str]:
    """One version per step, each the parent of the next (random 4 KiB payloads, none shared)."""
    versions: list[str] = []
    for step in steps:
        versions.append(_save(store, step, versions[-1] if versions else None, os.urandom(4096)))
        time.sleep(0.01)  # distinct save times: "newest" is by time
    return versions


class StoreBackendContract:
    """The behaviour every backend must show under :class:`CheckpointStore`. Subclasses provide a
    ``backend`` fixture returning a fresh, empty backend (``tmp_path`` is available to it)."""

    @pytest.fixture
    def store(self, backend: StoreBackend) -> CheckpointStore:
        return CheckpointStore(backend)

    def test_round_trip_with_checksums(self, store: CheckpointStore, tmp_path: Path) -> None:
        versions = chain(store, [10, 20, 30])
        assert store.tags()[LATEST] == versions[-1]
        m = store.materialize(LATEST, tmp_path / "out")
        assert m["step"] == 30 and m["parent"] == versions[1]
        assert (tmp_path / "out" / "model.bin").read_bytes()[-4:] == (30).to_bytes(4, "little")
        assert store.verify(versions[-1]) == []

    def test_a_corrupt_object_is_named_and_loading_falls_back_to_the_parent(
        self, store: CheckpointStore, tmp_path: Path
    ) -> None:
        versions = chain(store, [10, 20, 30])
        entry = store.manifest(versions[-1])["files"]["model.bin"]
        key = store.object_key(entry["sha256"])
        data = bytearray(store.backend.get(key))
        data[100] ^= 0xFF
        store.backend.put(key, bytes(data))
        assert any("checksum mismatch" in p for p in store.verify(versions[-1]))
        skipped: list[str] = []
        got = store.load_verified(tmp_path / "fallback", on_bad=lambda v, why: skipped.append(v))
        assert got is not None and got["version"] == versions[1] and skipped == [versions[-1]]

    def test_rollback_moves_latest_and_resolve_takes_tags_and_prefixes(self, store: CheckpointStore) -> None:
        versions = chain(store, [10, 20, 30])
        store.set_tag(LATEST, versions[0])
        assert store.resolve(LATEST) == versions[0] == store.resolve(versions[0][:9])
        with pytest.raises(StoreError, match="no version or tag"):
            store.resolve("s9999")

    def test_gc_keeps_the_newest_and_tagged_and_drops_unreferenced_objects(
        self, store: CheckpointStore
    ) -> None:
        versions = chain(store, [10, 20, 30])
        more = chain(store, [40, 50])
        store.set_tag(LATEST, more[-1])
        store.set_tag(LAST_GOOD, versions[0])
        deleted, removed = store.gc(keep=2)
        assert sorted(deleted) == sorted(versions[1:])
        assert [x["version"] for x in store.versions()] == [versions[0], *more]
        assert removed == 4  # two files per deleted version, none shared
        assert all(store.verify(v) == [] for v in [versions[0], *more])

    def test_identical_files_are_stored_once(self, store: CheckpointStore) -> None:
        store.write_version({"a": b"same", "b": b"same"}, step=1, parent=None, world_size=1)
        store.write_version({"a": b"same"}, step=2, parent=None, world_size=1)
        assert len(store.backend.keys("objects/")) == 1

    def test_an_empty_store_has_nothing_to_load(self, store: CheckpointStore, tmp_path: Path) -> None:
        assert store.load_verified(tmp_path / "x") is None
        assert store.versions() == []

    def test_create_writes_a_key_only_when_it_is_absent(self, backend: StoreBackend) -> None:
        try:
            first = backend.create("log/0000.json", b"first")
        except StoreError:
            pytest.skip(f"{backend.describe()} offers no create-if-absent (the model registry refuses it)")
        assert first is True
        assert backend.create("log/0000.json", b"second") is False
        assert backend.get("log/0000.json") == b"first"
        assert backend.keys("log/") == ["log/0000.json"]  # no temporary file left behind
