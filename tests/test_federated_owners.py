"""Each data owner brings its own data: clients with their own files, partitions users control.

The deployment test runs the server and each client as a separate OS user whose files no other
user may read (root only): the run completing proves no process needed another owner's rows.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tests._dist import ROOT
from tests.conftest import small_config

from vatra.config import dump_toml
from vatra.errors import ConfigError
from vatra.federated.certs import generate
from vatra.federated.client import LocalClient
from vatra.federated.data import build_federation
from vatra.federated.simulation import simulate
from vatra.launch import free_port
from vatra.rundir import RunDir, read_jsonl


def _write_csv(path: Path, rows: int, shift: float, seed: int, site: str | None = None) -> None:
    rng = np.random.default_rng(seed)
    w = np.array([1.0, -2.0, 0.5, 1.5])
    x = rng.normal(size=(rows, 4)) + shift
    y = (x @ w > shift * w.sum()).astype(int)
    head = ["f0", "f1", "f2", "f3", "label"] + (["site"] if site else [])
    lines = [",".join(head)]
    for r, label in zip(x, y, strict=True):
        lines.append(",".join([*(f"{v:.5f}" for v in r), str(label), *([site] if site else [])]))
    path.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------- deployment
@pytest.fixture
def shared_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vatra-owners-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _hidden(others: list[Path], *cmd: str) -> list[str]:
    """``cmd`` in a mount namespace of its own where ``others`` are empty (a tmpfs over each):
    even root cannot read what is not in its view."""
    mounts = " && ".join(f"mount -t tmpfs none {shlex.quote(str(p))}" for p in others)
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        f"{mounts} && exec {shlex.join(cmd)}",
    ]


def _vatra(home: Path, others: list[Path], *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(
        _hidden(others, sys.executable, "-m", "vatra", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=home,
        env=env,
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (mount namespaces)"
)
def test_two_owners_with_their_own_csv_over_tls_and_a_server_with_its_own_held_out_file(
    shared_dir: Path,
) -> None:
    # Prepare: a home per party (the server, clients 0 and 1) holding only its own data and
    # credentials; each process runs where the other homes are hidden.
    homes = {name: shared_dir / name for name in ("server", "c0", "c1")}
    for home in homes.values():
        home.mkdir()
    certs = shared_dir / "certs-all"
    generate(certs, 2)
    sizes = {"c0": 240, "c1": 160}
    for i, name in enumerate(("c0", "c1")):
        _write_csv(homes[name] / "mine.csv", sizes[name], shift=0.2 * i, seed=i)
        (homes[name] / "certs" / "clients").mkdir(parents=True)
        shutil.copy(certs / "ca.pem", homes[name] / "certs" / "ca.pem")
        shutil.copy(certs / "clients" / f"{i}.token", homes[name] / "certs" / "clients" / f"{i}.token")
    _write_csv(homes["server"] / "held.csv", 200, shift=0.1, seed=7)
    (homes["server"] / "certs").mkdir()
    for f in ("server.key", "server.pem", "tokens.json"):
        shutil.copy(certs / f, homes["server"] / "certs" / f)
    shutil.rmtree(certs)
    cfg = small_config(
        data={"name": "table", "target": "label"},
        model={"name": "mlp", "hidden": [16]},
        federated={"clients": 2, "rounds": 3, "local_epochs": 1, "min_clients": 2, "heartbeat_s": 0.5},
        monitor={"report": False},
    )
    for home in homes.values():
        (home / "fl.toml").write_text(dump_toml(cfg))

    def others(name: str) -> list[Path]:
        return [h for n, h in homes.items() if n != name]

    # The isolation is real: in the server's view, a client's file is not there.
    peek = subprocess.run(
        _hidden(others("server"), sys.executable, "-c", f"open({str(homes['c0'] / 'mine.csv')!r})"),
        capture_output=True,
        text=True,
    )
    assert peek.returncode != 0 and "FileNotFoundError" in peek.stderr, peek.stderr
    # Execute: the server with its own held-out file, each client with its own CSV.
    address = f"127.0.0.1:{free_port()}"
    server = _vatra(
        homes["server"],
        others("server"),
        "fl",
        "server",
        "fl.toml",
        "--address",
        address,
        "--certs",
        "certs",
        "--run-dir",
        "run",
        "--eval-data",
        "held.csv",
    )
    clients = [
        _vatra(
            homes[name],
            others(name),
            "fl",
            "client",
            "--server",
            address,
            "--client-id",
            str(i),
            "--config",
            "fl.toml",
            "--certs",
            "certs",
            "--data",
            "mine.csv",
        )
        for i, name in enumerate(("c0", "c1"))
    ]
    outs = [p.communicate(timeout=240)[0] for p in [server, *clients]]
    # Assert: everyone finished; the server scored its own 200 rows and heard both clients'
    # reports on their own held-out rows (20 % of each owner's file), every round.
    assert [p.returncode for p in [server, *clients]] == [0, 0, 0], "\n".join(outs)
    rows = read_jsonl(homes["server"] / "run" / "metrics.jsonl")
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(r["server_examples"] == 200 and r["evaluated_clients"] == 2 for r in rows)
    assert all(r["evaluated_examples"] == round(0.2 * 240) + round(0.2 * 160) for r in rows)
    assert rows[-1]["global_accuracy"] == rows[-1]["server_accuracy"]
    # What each client said about its data at join: shapes and a row count, no rows, no labels.
    joins = [e for e in read_jsonl(homes["server"] / "run" / "events.jsonl") if e["event"] == "joined"]
    assert sorted(e["rows"] for e in joins) == sorted(n - round(0.2 * n) for n in sizes.values())


@pytest.mark.slow(13)
def test_a_client_whose_data_does_not_fit_the_model_is_refused_in_one_line(tmp_path: Path) -> None:
    from tests._fl_helpers import start_client, start_server

    generate(tmp_path / "certs", 2)
    _write_csv(tmp_path / "held.csv", 50, 0.0, 1)
    narrow = tmp_path / "narrow.csv"
    narrow.write_text("f0,label\n" + "".join(f"{i / 10},{i % 2}\n" for i in range(40)))
    cfg = small_config(
        data={"name": "table", "target": "label"},
        federated={"clients": 2, "rounds": 1, "min_clients": 1, "join_timeout_s": 30},
        monitor={"report": False},
    )
    server, address = start_server(
        cfg, tmp_path / "certs", tmp_path / "run", eval_data=str(tmp_path / "held.csv")
    )
    bad = start_client(cfg, address, 1, tmp_path / "certs", data=str(narrow), retry_s=10)
    with pytest.raises(
        ConfigError, match=r"column 'f1': the federation's data has it, this owner's does not"
    ):
        bad.join_result(60)
    good = start_client(cfg, address, 0, tmp_path / "certs", data=str(tmp_path / "held.csv"))
    assert good.join_result(120) == 1
    assert server.join_result(60)["rounds"] == 1


# ------------------------------------------------------------------- partitions
def test_partition_file_is_reproduced_exactly_and_written_by_every_run(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    order = rng.permutation(1000)[:600]
    given = [sorted(order[i::3].tolist()) for i in range(3)]  # 600 of the rows, 200 per client
    (tmp_path / "part.json").write_text(json.dumps(given))
    cfg = small_config(
        federated={
            "clients": 3,
            "rounds": 1,
            "local_steps": 1,
            "workers": 1,
            "partition": {"method": "file", "file": str(tmp_path / "part.json")},
        },
        monitor={"report": False},
    )
    fed = build_federation(cfg)
    assert [s.tolist() for s in fed.shards] == given
    simulate(cfg, RunDir(tmp_path / "run"), progress=False)
    assert json.loads((tmp_path / "run" / "partition.json").read_text()) == given
    # A run's partition.json reproduces a synthetic partition exactly.
    dirichlet = small_config(federated={"clients": 4, "rounds": 1, "local_steps": 1, "workers": 1})
    simulate(dirichlet, RunDir(tmp_path / "d"), progress=False)
    again = dirichlet.model_copy(
        update={
            "federated": dirichlet.federated.model_copy(
                update={
                    "partition": dirichlet.federated.partition.model_copy(
                        update={"method": "file", "file": str(tmp_path / "d" / "partition.json")}
                    )
                }
            )
        }
    )
    assert [s.tolist() for s in build_federation(again).shards] == [
        s.tolist() for s in build_federation(dirichlet).shards
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([[0, 1], [1, 2], [3]], "row 1 is in the lists of clients"),
        ([[0, 1], [2]], "has 2 client lists but federated.clients = 3"),
        ([[0], [1], [10**6]], "outside the"),
        ({"a": 1}, "JSON list of per-client lists"),
    ],
)
def test_a_bad_partition_file_is_one_clear_error(tmp_path: Path, content: object, message: str) -> None:
    (tmp_path / "p.json").write_text(json.dumps(content))
    cfg = small_config(
        federated={"clients": 3, "partition": {"method": "file", "file": str(tmp_path / "p.json")}}
    )
    with pytest.raises(ConfigError, match=message):
        build_federation(cfg)


def test_column_partition_makes_one_client_per_owner(tmp_path: Path) -> None:
    parts = []
    for i, site in enumerate(["north", "south", "east"]):
        _write_csv(tmp_path / f"{site}.csv", 60 + 20 * i, 0.1 * i, i, site=site)
        parts.append((tmp_path / f"{site}.csv").read_text().splitlines())
    table = [parts[0][0]] + [line for p in parts for line in p[1:]]
    (tmp_path / "all.csv").write_text("\n".join(table) + "\n")
    cfg = small_config(
        data={"name": "table", "path": str(tmp_path / "all.csv"), "target": "label"},
        federated={"clients": 3, "partition": {"method": "column", "column": "site"}},
    )
    fed = build_federation(cfg)
    sites = fed.train.columns["site"]
    assert fed.owners == ["east", "north", "south"]
    for c, owner in enumerate(fed.owners):
        assert set(sites[fed.shards[c]]) == {owner}
    assert sum(len(s) for s in fed.shards) == len(fed.train)
    assert fed.spec.input_shape == (4,)  # the owner column is not a feature
    wrong = cfg.model_copy(update={"federated": cfg.federated.model_copy(update={"clients": 5})})
    with pytest.raises(ConfigError, match=r"3 distinct values.*set clients = 3"):
        build_federation(wrong)


def test_local_epochs_make_each_client_pass_once_over_its_rows() -> None:
    cfg = small_config(
        federated={
            "clients": 4,
            "local_epochs": 1,
            "workers": 1,
            "partition": {"method": "iid", "size_skew": 1.0},
        },
        train={"batch_size": 16},
    )
    fed = build_federation(cfg)
    client = LocalClient(cfg, fed.spec, fed.client_data)
    from vatra.federated import build_strategy

    strategy = build_strategy(cfg.federated, client.layout)
    strategy.initialize(client.init, 0)
    for c in range(4):
        data = fed.client_data(c)
        seen: list[int] = []
        fetch = data.train.get_batch

        def spy(idx: np.ndarray, fetch=fetch, seen=seen) -> object:  # type: ignore[no-untyped-def]
            seen.extend(np.asarray(idx).tolist())
            return fetch(idx)

        data.train.get_batch = spy  # type: ignore[method-assign]
        try:
            res, _ = client.fit(strategy.configure_round(1, [c])[c])
        finally:
            del data.train.get_batch
        # ⌈n_c / batch⌉ steps, and the training rows each exactly once (the probe reads none)
        assert res.metrics["steps"] == math.ceil(data.num_train / 16)
        assert sorted(seen) == sorted(data.train_rows.tolist())
        assert res.num_samples == data.num_train
    sizes = [fed.client_data(c).num_train for c in range(4)]
    assert len(set(sizes)) > 1  # unequal owners: the larger ones did more steps


def test_the_hospitals_example_simulates_its_sites_from_the_column(tmp_path: Path) -> None:
    import runpy

    from vatra.config import load_config

    runpy.run_path(str(ROOT / "examples" / "fl_owners" / "make_data.py"), run_name="__main__")
    config = ROOT / "examples" / "fl_owners" / "fl_owners.toml"
    cfg = load_config(config, ["federated.rounds=2", "monitor.report=false", "run.progress=off"])
    fed = build_federation(cfg)
    assert fed.owners == ["site_0", "site_1", "site_2"]
    assert [len(s) for s in fed.shards] == sorted((len(s) for s in fed.shards), reverse=True)  # 50/30/20 %
    summary = simulate(cfg, RunDir(tmp_path / "run"), progress=False)
    diagnosis = (ROOT / "examples" / "fl_owners" / "data" / "all_sites.csv").read_text().splitlines()
    header = next(csv.reader(diagnosis[:1])).index("diagnosis")
    labels = [row[header] for row in csv.reader(diagnosis[1:])]
    majority = max(labels.count(v) for v in set(labels)) / len(labels)  # benign: about 0.63
    assert summary["rounds"] == 2 and summary["server_accuracy"] > majority + 0.2, (summary, majority)


def test_bad_owner_inputs_are_one_error_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vatra.cli import main

    generate(tmp_path / "certs", 1)
    example = str(ROOT / "examples" / "fl_digits.toml")
    certs = str(tmp_path / "certs")
    (tmp_path / "p.json").write_text("[[0, 1]]")
    cases = [
        (["federate", example, "--set", 'federated.partition.method="column"'], "column"),
        (["federate", example, "--set", f'federated.partition.file="{tmp_path / "nope.json"}"',
          "--set", 'federated.partition.method="file"'], "cannot read"),
        (["federate", example, "--set", f'federated.partition.file="{tmp_path / "p.json"}"',
          "--set", 'federated.partition.method="file"'], "set clients = 1"),
        (["federate", example, "--set", "federated.local_epochs=-1"], "local_epochs"),
        (["fl", "client", "--server", "127.0.0.1:1", "--client-id", "0", "--config", example,
          "--certs", certs, "--data", str(tmp_path / "missing.csv")],
         f"--data {tmp_path / 'missing.csv'}: no such file"),
        (["fl", "server", example, "--address", "127.0.0.1:0", "--certs", certs,
          "--run-dir", str(tmp_path / "run"), "--eval-data", str(tmp_path / "missing.csv")],
         f"--eval-data {tmp_path / 'missing.csv'}: no such file"),
    ]  # fmt: skip
    for args, needle in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2, (args, err)
        assert err.startswith("error: ") and "\n" not in err and needle in err, (args, err)
