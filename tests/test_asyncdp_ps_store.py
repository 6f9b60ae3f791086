"""A parameter server's shard saves are versions of its own checkpoint store: listed by the store
and `vatra ckpt --sub`, pruned to keep_last, resumed past a corrupt or tampered version. In process:
no worker, no link (the server's TCP store is never used by a save or a resume)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests._dist import events
from tests.conftest import small_config

from vatra.asyncdp.ps import Server
from vatra.asyncdp.ps.server import SHARD, shard_store
from vatra.cli.app import main
from vatra.config import Config, dump_toml
from vatra.resilience import LATEST, CheckpointStore, StoreError, open_store
from vatra.rundir import RunDir

NUMELS = [3, 4]  # two parameters of a worker's model, one flat shard of 7


def _config(**store: object) -> Config:
    return small_config(
        dist={"mode": "async"},
        optim={"name": "sgd", "lr": 0.5, "momentum": 0.9},
        checkpoint={"keep_last": 2},
        store=store,
    )


def _server(cfg: Config, run: RunDir) -> Server:
    return Server(cfg, 0, 1, dist.HashStore(), run, incarnation=0)


def _trained(cfg: Config, run: RunDir, saves: int) -> list[torch.Tensor]:
    """A server whose shard takes 2 updates before each of ``saves`` saves: the params at each save."""
    srv = _server(cfg, run)
    srv._layout(NUMELS)
    assert srv.shard is not None
    srv.shard.init(torch.arange(7.0))
    saved = []
    for _ in range(saves):
        for _ in range(2):
            srv.shard.push(torch.linspace(-1.0, 1.0, 7), srv.shard.version, lr=0.5)
        srv.save()
        saved.append(srv.shard.pull().params)
    return saved


def _store(cfg: Config, run: RunDir) -> CheckpointStore:
    return open_store(cfg.store, run.checkpoints, sub=shard_store(0))


def test_a_saved_shard_is_a_version_of_the_servers_own_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: a run folder with its config (as `vatra train` leaves it)
    cfg, run = _config(), RunDir(tmp_path / "run").create()
    run.config.write_text(dump_toml(cfg))
    # Execute: two saves, 2 updates apart
    params = _trained(cfg, run, saves=2)
    # Assert: two versions after each other at the shard's version, in <run>/checkpoints/async/server-0
    versions = _store(cfg, run).versions()
    assert [(m["step"], m["parent"], m["world_size"]) for m in versions] == [
        (2, None, 1),
        (4, versions[0]["version"], 1),
    ]
    assert set(versions[1]["files"]) == {SHARD} and (run.checkpoints / "async/server-0/versions").is_dir()
    assert not open_store(cfg.store, run.checkpoints).versions()  # the run's own store is not touched
    # a fresh server resumes the newest: same parameters and version
    again = _server(cfg, run)
    assert again.resume() and again.shard is not None and again.shard.version == 4
    torch.testing.assert_close(again.shard.pull().params, params[-1], rtol=0, atol=0)
    # `vatra ckpt` reads the server's store with --sub
    capsys.readouterr()
    main(["ckpt", "list", str(run.path), "--sub", "async/server-0"])
    out = capsys.readouterr().out
    assert all(m["version"] in out for m in versions) and "latest" in out and "shard" in out
    main(["ckpt", "verify", str(run.path), "--sub", "async/server-0"])
    assert capsys.readouterr().out.count(": ok\n") == 2


def test_keep_last_prunes_the_servers_versions(tmp_path: Path) -> None:
    cfg, run = _config(), RunDir(tmp_path / "run").create()
    _trained(cfg, run, saves=4)
    store = _store(cfg, run)
    assert [m["step"] for m in store.versions()] == [6, 8]  # keep_last = 2
    assert len(store.backend.keys("objects/")) == 2  # the pruned versions' shards are deleted too


def test_a_corrupt_latest_shard_falls_back_to_its_parent(tmp_path: Path) -> None:
    # Prepare: two saves; the newest one's object loses its tail
    cfg, run = _config(), RunDir(tmp_path / "run").create()
    params = _trained(cfg, run, saves=2)
    store = _store(cfg, run)
    latest = store.manifest(LATEST)
    obj = run.checkpoints / shard_store(0) / store.object_key(latest["files"][SHARD]["sha256"])
    obj.write_bytes(obj.read_bytes()[:-8])
    # Execute
    srv = _server(cfg, run)
    assert srv.resume()
    # Assert: the parent's shard, the damage logged for this server; the next save follows the parent
    assert srv.shard is not None and srv.shard.version == 2
    torch.testing.assert_close(srv.shard.pull().params, params[0], rtol=0, atol=0)
    (corrupt,) = events(run.path, "checkpoint_corrupt")
    assert (corrupt["version"], corrupt["server"]) == (latest["version"], 0)
    srv.save()
    assert store.manifest(LATEST)["parent"] == latest["parent"]


def test_a_signed_server_store_refuses_a_tampered_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: a signed store; the newest manifest is then pointed at the older version's shard
    monkeypatch.setenv("VATRA_TEST_STORE_KEY", "secret")
    cfg, run = _config(hmac_key_env="VATRA_TEST_STORE_KEY"), RunDir(tmp_path / "run").create()
    _trained(cfg, run, saves=2)
    store = _store(cfg, run)
    older, newest = store.versions()
    path = run.checkpoints / shard_store(0) / "versions" / f"{newest['version']}.json"
    record = json.loads(path.read_text())
    record["files"] = older["files"]
    path.write_text(json.dumps(record))
    # Execute + Assert: the store refuses it, and a resume takes the intact older version
    with pytest.raises(StoreError, match="signature does not match"):
        store.manifest(newest["version"])
    srv = _server(cfg, run)
    assert srv.resume() and srv.shard is not None and srv.shard.version == older["step"] == 2
    (corrupt,) = events(run.path, "checkpoint_corrupt")
    assert corrupt["version"] == newest["version"] and "signature" in corrupt["problem"]


def test_store_url_and_erasure_nodes_get_a_folder_per_server(tmp_path: Path) -> None:
    nodes = [tmp_path / f"node{i}" for i in range(3)]
    erasure = _config(erasure={"k": 2, "m": 3, "nodes": [str(n) for n in nodes]})
    _trained(erasure, RunDir(tmp_path / "a").create(), saves=1)
    assert all(any((n / "async/server-0/objects").rglob("*")) for n in nodes)
    assert [m["step"] for m in _store(erasure, RunDir(tmp_path / "a")).versions()] == [2]
    url = _config(url=str(tmp_path / "bucket"))
    _trained(url, RunDir(tmp_path / "b").create(), saves=1)
    assert (tmp_path / "bucket/async/server-0/versions").is_dir()


def test_a_shard_file_from_before_the_store_is_resumed(tmp_path: Path) -> None:
    cfg, run = _config(), RunDir(tmp_path / "run").create()
    first = _server(cfg, RunDir(tmp_path / "first").create())
    first._layout(NUMELS)
    assert first.shard is not None
    first.shard.init(torch.arange(7.0))
    first.shard.push(torch.ones(7), 0, lr=0.5)
    legacy = run.checkpoints / "async" / "server-0.pt"
    legacy.parent.mkdir(parents=True)
    torch.save({"numels": NUMELS, "shard": first.shard.state_dict()}, legacy)
    srv = _server(cfg, run)
    assert srv.resume() and srv.shard is not None and srv.shard.version == 1
    torch.testing.assert_close(srv.shard.pull().params, first.shard.pull().params, rtol=0, atol=0)
