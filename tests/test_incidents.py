"""The incident history: a host that failed twice in an hour is left out of the next launch."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from vatra.launch.cluster import Cluster, ClusterSpec
from vatra.launch.incidents import history_path, record_launch, review
from vatra.monitor.rca_evidence import worker_failure_cause
from vatra.rundir import RunDir


def _failed(run: Path, rank: int, exit_code: int, signal: str | None, error: str = "") -> None:
    """A worker failure as the launcher records it, its cause from the run folder's evidence."""
    errors = run / "errors"
    if error:
        errors.mkdir(exist_ok=True)
        (errors / f"rank{rank:05d}.json").write_text(json.dumps({"message": error, "exit_code": exit_code}))
    cause = worker_failure_cause(run, rank, exit_code, signal, errors)
    RunDir(run).log_event("worker_failed", rank=rank, exit_code=exit_code, signal=signal, cause=cause)


def test_two_host_faults_in_an_hour_exclude_the_host_and_user_errors_do_not(tmp_path: Path) -> None:
    # Prepare: host a's ranks killed twice (two launches); host b's run failed on a user's error twice
    path = tmp_path / "incidents" / "shaped.json"
    for n in range(2):
        run = RunDir(tmp_path / f"a{n}").create().path
        began = time.time()
        _failed(run, 1, -9, "SIGKILL")
        assert record_launch(run, "10.213.0.1", began, path) == 1
        run_b = RunDir(tmp_path / f"b{n}").create().path
        _failed(run_b, 0, 1, None, "KeyError: 'label' (raised in my_model.py)")
        assert record_launch(run_b, "10.213.0.2", began, path) == 0  # the user's code: not the host's fault
    hosts = ["10.213.0.1", "10.213.0.2"]
    # Execute
    now = review(hosts, path)
    later = review(hosts, path, now=time.time() + 3601)  # an hour on: both incidents are old
    alone = review(["10.213.0.1"], path)  # the only host cannot be left out
    # Assert
    (decision,) = now
    assert decision.host == "10.213.0.1" and decision.excluded
    assert [i["cause"] for i in decision.incidents] == ["dead_node", "dead_node"]
    assert decision.line() == (
        "incidents: host 10.213.0.1 failed 2 times in the last hour (dead node ×2): excluded from this launch"
    )
    assert later == []
    assert not alone[0].excluded and "launching on it as asked" in alone[0].line()


def test_the_cluster_launches_on_the_hosts_left_with_the_rendezvous_on_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: host h0 (which hosts the rendezvous) failed twice in the last hour
    monkeypatch.setenv("VATRA_INCIDENTS_DIR", str(tmp_path))
    now = time.time()
    incidents = [{"time": now - 60 * m, "cause": "oom", "run": "r", "rank": 0} for m in (1, 2)]
    history_path("shaped").write_text(json.dumps({"hosts": {"10.213.0.1": incidents}}))
    cluster = Cluster(ClusterSpec(name="shaped", hosts=3))
    # Execute
    hosts = cluster._admitted()
    argv = cluster.host_command(hosts[1], ["vatra", "train", "cfg.toml"], "job", hosts=hosts)
    # Assert: h1 and h2 run the job as a 2-node one, h1 node 0 with the rendezvous
    assert [h.address for h in hosts] == ["10.213.0.2", "10.213.0.3"]
    flags = dict(zip(argv[::2], argv[1::2], strict=False)) | dict(zip(argv[1::2], argv[2::2], strict=False))
    assert flags["--nnodes"] == "2" and flags["--node-rank"] == "1"
    assert flags["--rdzv-endpoint"].startswith("10.213.0.2:")
    assert "host 10.213.0.1 failed 2 times in the last hour (oom ×2): excluded" in capsys.readouterr().out
