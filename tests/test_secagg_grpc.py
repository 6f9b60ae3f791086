"""Secure aggregation over the TLS gRPC deployment: the same model as the simulation, a drop-out survived."""

from __future__ import annotations

from pathlib import Path

from tests._fl_helpers import start_client, start_server
from tests.conftest import small_config

from vatra.federated.certs import generate
from vatra.federated.data import build_federation
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl


def _cfg(**chaos: object):
    return small_config(
        federated={
            "clients": 4,
            "selection": "all",
            "rounds": 2,
            "local_steps": 2,
            "workers": 1,
            "min_clients": 3,
            "secure_aggregation": {"enabled": True},
        },
        chaos=chaos,
    )


def test_secure_round_over_grpc_gives_the_simulated_model(tmp_path: Path) -> None:
    # Prepare: 4 clients, t = 3; in round 2 one client goes silent before its masked input.
    cfg = _cfg(drop_clients_at={"round": 2, "stage": "masked_input", "count": 1})
    generate(tmp_path / "certs", 4)
    # Execute: simulation, then a real TLS server on loopback with 4 client threads.
    simulated = simulate(cfg, RunDir(tmp_path / "sim"), progress=False)
    server, address = start_server(cfg, tmp_path / "certs", tmp_path / "deploy")
    fed = build_federation(cfg)  # each deployed client holds exactly its simulated twin's rows
    clients = [start_client(cfg, address, c, tmp_path / "certs", data=fed.client_data(c)) for c in range(4)]
    deployed = server.join_result(180)
    # Assert: masked sums are exact in the ring, so the two models are bit-identical.
    assert [c.join_result(30) for c in clients] == [2, 2, 2, 2]
    assert deployed["weights_sha256"] == simulated["weights_sha256"]
    assert deployed["secure_aggregation"]["dropouts_survived"] == 1
    rows = read_jsonl(tmp_path / "deploy" / "metrics.jsonl")
    assert [r["secagg_survivors"] for r in rows] == [4, 3]
    assert all(r["bytes_up"] > 0 for r in rows)
