"""The versioned store on a local directory and on a real S3 server (moto), and erasure coding."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import pytest

from vatra.resilience import LAST_GOOD, LATEST, CheckpointStore, ErasureBackend, FsspecBackend, StoreError
from vatra.resilience.erasure import decode, encode, parse_shard


def _save(store: CheckpointStore, step: int, parent: str | None, payload: bytes) -> str:
    files = {"model.bin": payload + step.to_bytes(4, "little"), "rank00000.pt": b"rank state %d" % step}
    return str(
        store.write_version(files, step=step, parent=parent, world_size=1, tags=(LAST_GOOD,))["version"]
    )


def _chain(store: CheckpointStore, steps: list[int]) -> list[str]:
    versions: list[str] = []
    for step in steps:
        versions.append(_save(store, step, versions[-1] if versions else None, os.urandom(4096)))
        time.sleep(0.01)  # distinct save times: "newest" is by time
    return versions


def store_contract(store: CheckpointStore, tmp: Path) -> None:
    """The behaviour every backend must show: round trip, tags, corrupt fallback, rollback, gc."""
    # Prepare
    versions = _chain(store, [10, 20, 30])
    # Execute / Assert: round trip with checksums
    assert store.tags()[LATEST] == versions[-1]
    m = store.materialize(LATEST, tmp / "out")
    assert m["step"] == 30 and m["parent"] == versions[1]
    assert (tmp / "out" / "model.bin").read_bytes()[-4:] == (30).to_bytes(4, "little")
    assert store.verify(versions[-1]) == []
    # a corrupt object in the newest version: verify names it, loading falls back to the parent
    entry = m["files"]["model.bin"]
    key = store.object_key(entry["sha256"])
    data = bytearray(store.backend.get(key))
    data[100] ^= 0xFF
    store.backend.put(key, bytes(data))
    assert any("checksum mismatch" in p for p in store.verify(versions[-1]))
    skipped: list[str] = []
    got = store.load_verified(tmp / "fallback", on_bad=lambda v, why: skipped.append(v))
    assert got is not None and got["version"] == versions[1] and skipped == [versions[-1]]
    # rollback = move `latest`; resolve accepts tags and unique prefixes
    store.set_tag(LATEST, versions[0])
    assert store.resolve(LATEST) == versions[0] == store.resolve(versions[0][:9])
    with pytest.raises(StoreError, match="no version or tag"):
        store.resolve("s9999")
    # gc keeps the newest N plus tagged versions, and drops unreferenced objects
    more = _chain(store, [40, 50])
    store.set_tag(LATEST, more[-1])
    store.set_tag(LAST_GOOD, versions[0])
    deleted, removed = store.gc(keep=2)
    assert sorted(deleted) == sorted(versions[1:])
    assert [x["version"] for x in store.versions()] == [versions[0], *more]
    assert removed == 4  # two files per deleted version, none shared
    assert all(store.verify(v) == [] for v in [versions[0], *more])


def test_local_store_contract(tmp_path: Path) -> None:
    store_contract(CheckpointStore(FsspecBackend(str(tmp_path / "store"))), tmp_path)


def test_identical_files_are_stored_once(tmp_path: Path) -> None:
    store = CheckpointStore(FsspecBackend(str(tmp_path / "store")))
    store.write_version({"a": b"same", "b": b"same"}, step=1, parent=None, world_size=1)
    store.write_version({"a": b"same"}, step=2, parent=None, world_size=1)
    assert len(store.backend.keys("objects/")) == 1


def test_empty_store_has_nothing_to_load(tmp_path: Path) -> None:
    store = CheckpointStore(FsspecBackend(str(tmp_path / "store")))
    assert store.load_verified(tmp_path / "x") is None
    assert store.versions() == []


# ------------------------------------------------------------------ erasure
@pytest.mark.parametrize("size", [0, 1, 4, 1001, 65536 + 3])
def test_zfec_any_k_of_m_restores_bytes(size: int) -> None:
    data = os.urandom(size)
    shards = encode(data, 4, 6)
    for keep in itertools.combinations(range(6), 4):
        payloads = {i: parse_shard(shards[i]).payload for i in keep}
        assert decode(payloads, 4, 6, size) == data


def _erasure(tmp: Path) -> ErasureBackend:
    return ErasureBackend(4, 6, [str(tmp / f"node{i}") for i in range(6)])


def test_erasure_store_contract(tmp_path: Path) -> None:
    store_contract(CheckpointStore(_erasure(tmp_path)), tmp_path)


def test_erasure_survives_m_minus_k_lost_shards_and_repairs(tmp_path: Path) -> None:
    # Prepare
    backend = _erasure(tmp_path)
    store = CheckpointStore(backend)
    payload = os.urandom(50_000)
    digest = store.put_object(payload)
    key = store.object_key(digest)
    for lost in itertools.combinations(range(6), 2):
        # Execute: delete one shard, corrupt another (both count against m − k = 2)
        (tmp_path / f"node{lost[0]}" / key).unlink()
        shard = tmp_path / f"node{lost[1]}" / key
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0x01
        shard.write_bytes(bytes(raw))
        # Assert: byte-identical restore, then repair rewrites exactly the two damaged shards
        assert store.get_object(digest) == payload
        repaired = backend.repair(key)
        assert len(repaired) == 2 and all(f"shard {i}" in " ".join(repaired) for i in lost)
        assert backend.repair(key) == []
    # one shard too many: a clear error, not garbage
    for i in range(3):
        (tmp_path / f"node{i}" / key).unlink()
    with pytest.raises(StoreError, match="only 3 of 6 shards intact, 4 needed"):
        store.get_object(digest)


def test_erasure_config_is_validated() -> None:
    from vatra.config import config_from_dict
    from vatra.errors import ConfigError

    with pytest.raises(ConfigError, match=r"store\.erasure"):
        config_from_dict({"store": {"erasure": {"k": 4, "m": 6, "nodes": ["a", "b"]}}})
    with pytest.raises(ConfigError, match="k < m"):
        config_from_dict({"store": {"erasure": {"k": 6, "m": 6, "nodes": list("abcdef")}}})


# ----------------------------------------------------------------------- S3
def test_s3_store_contract(s3_server: dict, tmp_path: Path) -> None:
    store = CheckpointStore(FsspecBackend("s3://ckpt-bucket/run1", s3_server))
    store_contract(store, tmp_path)
