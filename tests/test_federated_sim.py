"""``vatra federate``: the run folder, determinism across worker counts, errors as one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests._fl_helpers import start_client, start_server
from tests.conftest import small_config

from vatra.cli import main
from vatra.federated.certs import generate
from vatra.federated.data import build_federation
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl

ROUND_KEYS = {
    "round",
    "global_accuracy",
    "mean_client_accuracy",
    "worst_client_accuracy",
    "bytes_up",
    "bytes_down",
    "round_time_s",
    "selected",
}


def _cfg(workers: int):
    return small_config(
        federated={
            "strategy": "fedprox",
            "mu": 0.01,
            "clients": 6,
            "clients_per_round": 4,
            "rounds": 3,
            "local_steps": 3,
            "workers": workers,
            "partition": {"method": "dirichlet", "alpha": 0.5, "feature_shift": ["identity", "invert"]},
        },
    )


def test_simulation_writes_the_run_folder(tmp_path: Path) -> None:
    summary = simulate(_cfg(1), RunDir(tmp_path), progress=False)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r.keys() >= ROUND_KEYS and len(r["selected"]) == 4 for r in rows)
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in rows)
    assert 0.0 <= rows[-1]["worst_client_accuracy"] <= rows[-1]["mean_client_accuracy"] <= 1.0
    assert json.loads((tmp_path / "summary.json").read_text())["weights_sha256"] == summary["weights_sha256"]
    assert (tmp_path / "config.toml").exists()
    assert "global_accuracy" in (tmp_path / "report.html").read_text()  # the per-round curves


def test_federate_cli_runs_and_reports_bad_config_in_one_line(
    tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = str(root / "examples" / "fl_digits.toml")
    steps = ["--set", "federated.workers=1", "--set", "federated.local_steps=2"]
    main(["federate", example, "--set", "federated.rounds=2", *steps, "--run-dir", str(tmp_path / "run")])
    assert "round 2/2" in capsys.readouterr().out
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["federate", example, "--set", "federated.strategy=kmeans"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: federated.strategy") and "Traceback" not in err


def test_same_seed_same_model_in_simulation_and_in_a_tls_deployment(tmp_path: Path) -> None:
    # Prepare: one config; a real gRPC server with TLS on loopback and two clients.
    cfg = small_config(
        federated={"clients": 2, "rounds": 3, "local_steps": 3, "workers": 2, "min_clients": 2},
        monitor={"report": False},
    )
    generate(tmp_path / "certs", 2)
    # Execute: the simulation on a pool of 2 processes, then the deployment.
    # Each deployed client holds only the rows its simulated twin owned (its own train and
    # held-out rows); the server's own held-out data is the simulation's validation split.
    simulated = simulate(cfg, RunDir(tmp_path / "sim"), progress=False)
    fed = build_federation(cfg)
    server, address = start_server(cfg, tmp_path / "certs", tmp_path / "deploy", eval_data=fed.server_val)
    own = [fed.client_data(c) for c in range(2)]
    clients = [start_client(cfg, address, c, tmp_path / "certs", data=own[c]) for c in range(2)]
    deployed = server.join_result(120)
    # Assert: bit-identical weights and identical per-round accuracy, the server's and the clients'.
    assert [c.join_result(30) for c in clients] == [3, 3]
    assert deployed["weights_sha256"] == simulated["weights_sha256"]
    sim_rows = read_jsonl(tmp_path / "sim" / "metrics.jsonl")
    dep_rows = read_jsonl(tmp_path / "deploy" / "metrics.jsonl")
    for key in ("server_accuracy", "client_accuracy", "worst_client_accuracy"):
        assert [r[key] for r in sim_rows] == [r[key] for r in dep_rows], key
    assert all(r["failures"] == 0 for r in dep_rows)
