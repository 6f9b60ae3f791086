"""Deployment over gRPC with TLS: bad clients rejected, a client killed mid-round, the server restarted."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from tests._dist import run_vatra, start_vatra
from tests._fl_helpers import join_body, start_client, start_server
from tests.conftest import small_config

from vatra.config import Config, dump_toml
from vatra.federated import EvalRes, FitRes
from vatra.federated.certs import client_credentials, generate
from vatra.federated.grpc import RemoteServer
from vatra.federated.server import weights_digest
from vatra.federated.wire import decode, decode_ins, encode_eval_res, encode_res
from vatra.launch import free_port
from vatra.rundir import read_jsonl


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    generate(folder, 3)
    return folder


def _cfg(**federated: object) -> Config:
    base = {"local_steps": 2, "heartbeat_s": 0.5, "heartbeat_misses": 6, "round_deadline_s": 60}
    return small_config(federated={**base, **federated}, monitor={"report": False})


def _next_task(remote: RemoteServer) -> FitRes:
    for _ in range(60):
        blob = remote.call("Poll")
        if decode(blob)[0].get("kind") == "fit_ins":
            ins = decode_ins(blob)
            if ins.config.get("phase") == "evaluate":  # nothing held out: an empty report
                remote.call("Submit", encode_eval_res(EvalRes(0, ins.round, 0, {})))
                continue
            return FitRes(0, ins.round, 10, np.zeros(ins.models[0].shape, np.float32))
    raise AssertionError("no task within 60 polls")


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == kind]


def test_wrong_token_wrong_shape_and_nan_are_rejected(tmp_path: Path, certs: Path) -> None:
    # Prepare: a one-client federation; the test speaks the protocol itself.
    cfg = _cfg(clients=1, rounds=2, min_clients=1)
    server, address = start_server(cfg, certs, tmp_path / "run")
    ca, token = client_credentials(certs, 0)
    # Wrong token, and a valid token under another client's id: both unauthenticated.
    for cid, tok in ((0, "not-the-token"), (1, token)):
        with pytest.raises(grpc.RpcError) as err:
            RemoteServer(address, ca, cid, tok).call("Join", join_body(cfg), timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    remote = RemoteServer(address, ca, 0, token)
    remote.call("Join", join_body(cfg))
    # Round 1: an update of the wrong shape; round 2: an update with a NaN.
    res = _next_task(remote)
    res.update = np.zeros(res.update.size + 1, np.float32)
    with pytest.raises(grpc.RpcError) as err:
        remote.call("Submit", encode_res(res))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "shape" in str(err.value.details())
    res = _next_task(remote)
    res.update[3] = np.nan
    with pytest.raises(grpc.RpcError) as err:
        remote.call("Submit", encode_res(res))
    assert "non-finite" in str(err.value.details())
    summary = server.join_result(60)
    remote.close()
    # Assert: nothing reached the aggregate (the weights are the initial ones), every reason logged.
    from vatra.data import build_dataset
    from vatra.federated.client import initial_weights

    spec = build_dataset(cfg.data, cfg.run.seed).spec
    assert summary["weights_sha256"] == weights_digest(initial_weights(cfg, spec)[2])
    assert len(_events(tmp_path / "run", "rejected")) == 1  # one line per host every 10 s
    reasons = [e["reason"] for e in _events(tmp_path / "run", "update_rejected")]
    assert any("shape" in r for r in reasons) and any("non-finite" in r for r in reasons)
    assert [r["failures"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 1]


def _client_process(
    cfg_path: Path, address: str, cid: int, certs: Path, *extra: str
) -> subprocess.Popen[str]:
    args = ["fl", "client", "--server", address, "--client-id", str(cid), "--config", str(cfg_path)]
    return start_vatra(*args, "--certs", str(certs), *extra, stderr=subprocess.STDOUT)


def _wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow(26)
def test_client_killed_mid_round_the_round_completes_with_the_others(tmp_path: Path, certs: Path) -> None:
    # Prepare: 3 clients, at least 2 per round; client 2 is a process that dawdles before uploading.
    # A 10 s join grace (heartbeat 0.5 s × 20): the two client threads must both be in round 1,
    # and on a loaded machine one may join seconds after the other.
    cfg = _cfg(clients=3, rounds=2, min_clients=2, heartbeat_misses=20)
    cfg_path = tmp_path / "fl.toml"
    cfg_path.write_text(dump_toml(cfg))
    server, address = start_server(cfg, certs, tmp_path / "run")
    slow = _client_process(cfg_path, address, 2, certs, "--slow-s", "120")
    _wait_for(lambda: _events(tmp_path / "run", "joined"), 120, "client 2 to join")
    fast = [start_client(cfg, address, c, certs) for c in (0, 1)]
    # Execute: kill client 2 once it holds its round-1 task.
    _wait_for(lambda: any(e["client"] == 2 for e in _events(tmp_path / "run", "task_sent")), 60, "a task")
    time.sleep(0.5)
    slow.send_signal(signal.SIGKILL)
    slow.wait(10)
    summary = server.join_result(120)
    # Assert: round 1 selected all three, lost client 2, and still aggregated; round 2 went on.
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["selected"] == [0, 1, 2] and rows[0]["failures"] == 1
    assert rows[1]["selected"] == [0, 1] and rows[1]["failures"] == 0
    failed = _events(tmp_path / "run", "client_failed")
    assert [(e["round"], e["client"]) for e in failed] == [(1, 2)] and "dropped out" in failed[0]["reason"]
    assert not _events(tmp_path / "run", "round_skipped")
    assert summary["rounds"] == 2 and [c.join_result(30) for c in fast] == [2, 2]


@pytest.mark.slow(14)
def test_server_killed_and_restarted_resumes_at_the_right_round(tmp_path: Path, certs: Path) -> None:
    # Prepare: a server process and two clients that take ≥ 0.5 s per round.
    cfg = _cfg(clients=2, rounds=4, min_clients=2)
    cfg_path = tmp_path / "fl.toml"
    cfg_path.write_text(dump_toml(cfg))
    address = f"127.0.0.1:{free_port()}"
    run = tmp_path / "run"
    cmd = ["fl", "server", str(cfg_path), "--address", address, "--certs", str(certs), "--run-dir", str(run)]
    first = start_vatra(*cmd, stdout=subprocess.DEVNULL)
    clients = [start_client(cfg, address, c, certs, slow_s=0.5, retry_s=120) for c in range(2)]

    # Execute: SIGKILL the server after two rounds, start it again on the same run folder.
    def two_rounds() -> bool:
        assert first.poll() is None, f"server exited early: {first.stderr.read() if first.stderr else ''}"
        return len(read_jsonl(run / "metrics.jsonl")) >= 2

    _wait_for(two_rounds, 180, "two rounds")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    done_before = len(read_jsonl(run / "metrics.jsonl"))
    second = run_vatra(*cmd)
    # Assert: it resumed after the last checkpointed round, and every round is logged exactly once.
    assert second.returncode == 0, second.stderr
    assert [e["round"] for e in _events(run, "resumed")] == [done_before + 1]
    assert [r["round"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [c.join_result(60) for c in clients] == [4 - 0, 4 - 0] or all(
        c.join_result(60) >= 4 for c in clients
    )
