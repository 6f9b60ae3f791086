"""A federated server's rounds are versions of the store: [store] applies, vatra ckpt reads them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tests.conftest import small_config

from vatra.cli.app import main
from vatra.config import dump_toml
from vatra.federated.checkpoint import CHECKPOINT
from vatra.federated.simulation import simulate
from vatra.resilience import LATEST, open_store
from vatra.rundir import RunDir, read_jsonl


def test_a_federated_run_on_an_erasure_coded_store_resumes_after_losing_a_node(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: 2 of 3 rounds through `vatra federate` on an erasure-coded store (k 2 of m 3 nodes)
    nodes = [tmp_path / f"node{i}" for i in range(3)]
    store = {"erasure": {"k": 2, "m": 3, "nodes": [str(n) for n in nodes]}}
    fed = {"clients": 2, "rounds": 3, "local_steps": 1, "workers": 1}
    cfg = small_config(federated=fed, monitor={"report": False}, store=store)
    run = RunDir(tmp_path / "run")
    (tmp_path / "fl.toml").write_text(dump_toml(cfg))
    federate = ["federate", str(tmp_path / "fl.toml"), "--run-dir", str(run.path)]
    main([*federate, "--set", "federated.rounds=2"])
    assert all(any(n.rglob("*")) for n in nodes)  # every node holds a shard of every object
    assert not (run.checkpoints / "server.safetensors").exists()
    # Execute: one node's whole shard directory is lost, then the run goes on to round 3
    shutil.rmtree(nodes[0])
    main(federate)
    # Assert: resumed at round 3 from the two surviving nodes, same model as an uninterrupted run
    events = read_jsonl(run.events)
    assert [e["round"] for e in events if e["event"] == "resumed"] == [3]
    assert not [e for e in events if e["event"] == "checkpoint_corrupt"]
    assert [r["round"] for r in read_jsonl(run.metrics)] == [1, 2, 3]
    plain = cfg.model_copy(update={"store": type(cfg.store)()})
    straight = simulate(plain, RunDir(tmp_path / "straight"), progress=False)
    assert json.loads(run.summary.read_text())["weights_sha256"] == straight["weights_sha256"]
    # the three rounds are versions, each after the previous one; `vatra ckpt` lists and verifies them
    versions = open_store(cfg.store, run.checkpoints).versions()
    assert [(m["step"], m["parent"]) for m in versions] == [
        (1, None),
        (2, versions[0]["version"]),
        (3, versions[1]["version"]),
    ]
    capsys.readouterr()
    main(["ckpt", "list", str(run.path)])
    out = capsys.readouterr().out
    assert all(m["version"] in out for m in versions) and "latest" in out
    main(["ckpt", "verify", str(run.path)])
    assert capsys.readouterr().out.count(": ok\n") == 3


def test_a_federated_resume_falls_back_past_a_corrupt_round(tmp_path: Path) -> None:
    # Prepare: 2 rounds on the default store (<run>/checkpoints); round 2's object is then damaged
    cfg = small_config(federated={"clients": 2, "rounds": 2, "local_steps": 1}, monitor={"report": False})
    run = RunDir(tmp_path / "run")
    simulate(cfg, run, progress=False)
    store = open_store(cfg.store, run.checkpoints)
    latest = store.manifest(LATEST)
    obj = run.checkpoints / store.object_key(latest["files"][CHECKPOINT]["sha256"])
    obj.write_bytes(obj.read_bytes()[:-8])
    # Execute: the run goes on to round 3
    more = cfg.model_copy(update={"federated": cfg.federated.model_copy(update={"rounds": 3})})
    summary = simulate(more, run, progress=False)
    # Assert: round 2 is done again from round 1's version; the damage is logged, the model the same
    events = read_jsonl(run.events)
    assert [e["round"] for e in events if e["event"] == "resumed"] == [2]
    assert [e["version"] for e in events if e["event"] == "checkpoint_corrupt"] == [latest["version"]]
    straight = simulate(more, RunDir(tmp_path / "straight"), progress=False)
    assert summary["weights_sha256"] == straight["weights_sha256"] and summary["rounds"] == 3
    assert store.manifest(LATEST)["step"] == 3
