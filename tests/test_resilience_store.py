"""The versioned store on a local directory and on a real S3 server (moto), and erasure coding."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from vatra.resilience import CheckpointStore, ErasureBackend, FsspecBackend, StoreBackend, StoreError
from vatra.resilience.erasure import decode, encode, parse_shard
from vatra.resilience.testing import StoreBackendContract


class TestStoreContract(StoreBackendContract):
    """The reusable store suite (vatra.resilience.testing) on every built-in backend: a local folder,
    erasure coding over 6 folders (k = 4), and S3 through fsspec on a real S3 server (moto)."""

    @pytest.fixture(params=["local", "erasure", "s3"])
    def backend(self, request: pytest.FixtureRequest, tmp_path: Path) -> StoreBackend:
        if request.param == "local":
            return FsspecBackend(str(tmp_path / "store"))
        if request.param == "erasure":
            return _erasure(tmp_path)
        return FsspecBackend(f"s3://ckpt-bucket/{tmp_path.name}", request.getfixturevalue("s3_server_shared"))


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
