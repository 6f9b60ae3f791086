"""``federated.backend = "ray"``: the clients' rounds on Ray actors give the in-process results."""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.conftest import small_config

from vatra.errors import ConfigError
from vatra.federated._base import FitIns
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl


def _ray_processes(marker: str) -> list[int]:
    """Pids of the processes whose command line names ``marker`` (Ray's session folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.fixture
def ray_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh, short folder for this test's Ray session (its socket paths must stay short)."""
    pytest.importorskip("ray")
    folder = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(folder))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    yield folder
    import ray

    ray.shutdown()  # a no-op unless the run failed before it stopped its own Ray
    shutil.rmtree(folder, ignore_errors=True)


def _config(backend: str, **fed: object) -> object:
    return small_config(
        monitor={"report": False},
        optim={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        federated={
            "clients": 7,
            "clients_per_round": 5,
            "rounds": 2,
            "local_steps": 3,
            "evaluate_clients": 4,
            "backend": backend,
            "workers": 2,
            **fed,
        },
    )


# Ray's start-up is most of these tests (8-11 s alone, 80-100 s in a full run): one worker runs both
@pytest.mark.xdist_group("ray")
@pytest.mark.slow(100)
def test_the_ray_backend_gives_the_in_process_aggregate(tmp_path: Path, ray_tmp: Path) -> None:
    # Prepare: the in-process reference, vmapped in this process (workers = 1)
    reference = simulate(_config("inprocess", workers=1), RunDir(tmp_path / "inproc"), progress=False)  # type: ignore[arg-type]
    # Execute: the same run on a local Ray, its 5 clients a round split over 2 actors
    on_ray = simulate(_config("ray"), RunDir(tmp_path / "ray"), progress=False)  # type: ignore[arg-type]
    # Assert: the same final weights, bit for bit, and the same per-round metrics
    assert on_ray["weights_sha256"] == reference["weights_sha256"]
    ref_rows = read_jsonl(tmp_path / "inproc" / "metrics.jsonl")
    ray_rows = read_jsonl(tmp_path / "ray" / "metrics.jsonl")
    for a, b in zip(ref_rows, ray_rows, strict=True):
        assert a["selected"] == b["selected"]
        assert a["evaluated_clients"] == b["evaluated_clients"] == 4
        for key in ("train_loss", "global_loss", "global_accuracy", "client_loss"):
            assert a.get(key) == b.get(key), key
    # the clients really ran in Ray worker processes, and the local Ray is gone afterwards
    assert any(ray_tmp.glob("**/session_*/logs/worker-*")), "no Ray worker ran"
    assert _ray_processes(str(ray_tmp)) == []


def test_a_missing_ray_is_one_line_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'vatra\[ray\]'") as err:
        simulate(_config("ray"), RunDir(tmp_path), progress=False)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_an_address_where_no_ray_listens_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = _config("ray", ray_address=f"127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=r"no Ray cluster to join.*ray start --head") as err:
        simulate(cfg, RunDir(tmp_path), progress=False)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


@pytest.mark.xdist_group("ray")
@pytest.mark.slow(80)
def test_a_lost_ray_worker_fails_its_clients_not_the_round(ray_tmp: Path) -> None:
    import ray

    from vatra.federated.client import initial_weights
    from vatra.federated.data import build_federation
    from vatra.federated.raypool import RayExecutor

    # Prepare: 2 actors on a local Ray; the one that holds the odd clients is gone
    cfg = _config("ray")
    fed = build_federation(cfg)  # type: ignore[arg-type]
    _, layout, init = initial_weights(cfg, fed.spec)  # type: ignore[arg-type]
    executor = RayExecutor(cfg, fed)  # type: ignore[arg-type]
    try:
        ray.kill(executor.actors[1], no_restart=True)
        conf = {"local_steps": 2, "local_epochs": 0, "mu": 0.0}
        ins = {c: FitIns(c, 1, [init], conf) for c in range(5)}
        # Execute
        results, failures, _, _ = executor.fit(1, ins, layout.size)
        reports, lost = executor.evaluate(1, ins)
    finally:
        executor.close()
    # Assert: the even clients trained and reported, the odd ones failed with a reason
    assert [r.client_id for r in results] == [0, 2, 4]
    assert [f.client_id for f in failures] == [1, 3]
    assert all("Ray worker was lost" in f.reason for f in failures)
    assert [r.client_id for r in reports] == [0, 2, 4] and [f.client_id for f in lost] == [1, 3]
    assert _ray_processes(str(ray_tmp)) == []
