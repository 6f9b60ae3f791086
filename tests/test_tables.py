"""Delta tables end to end: ingest against the pinned schema, versions a run is pinned to, the
standard format, drift refusals in training, S3, and federated owners reading their own table."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests._dist import run_vatra
from tests.conftest import vatra_in_process

pa = pytest.importorskip("pyarrow")
pytest.importorskip("deltalake")
pytest.importorskip("pandera")
import pyarrow.csv as pcsv  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from vatra.errors import ConfigError  # noqa: E402


def sensor_rows(n: int, seed: int, *, site: str = "north", scale: float = 1.0) -> pa.Table:
    """A small equipment table: two sensors, a site, and a 0/1 failure label that depends on them."""
    rng = np.random.default_rng(seed)
    temp = rng.normal(60.0, 8.0, n)
    load = rng.uniform(10.0, 90.0, n)
    fail = ((temp - 60) / 8 + (load - 50) / 25 + rng.normal(0, 0.5, n) > 0.8).astype(np.int64)
    return pa.table(
        {
            "temp": temp * scale,
            "load": load,
            "hours": rng.integers(0, 5000, n),
            "site": [site] * n,
            "failed": fail,
        }
    )


def write_csv(table: pa.Table, path: Path) -> Path:
    pcsv.write_csv(table, path)
    return path


def delta_config(path: Path, table: Path, target: str = "failed", **data: object) -> Path:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in data.items())
    path.write_text(
        f"""[run]
name = "delta"
out_dir = "{path.parent / "runs"}"
progress = "off"
tensorboard = false

[data]
name = "delta"
path = "{table}"
target = "{target}"
categorical = ["site"]
{extra}
[model]
name = "mlp"
hidden = [16]

[train]
steps = 6
batch_size = 16
eval_every = 0

[monitor]
report = false

[checkpoint]
enabled = false
"""
    )
    return path


def test_ingest_pins_schema_refuses_bad_batch_and_force_records(tmp_path: Path, capsys) -> None:
    from deltalake import DeltaTable

    table = tmp_path / "sensors"
    first = write_csv(sensor_rows(200, 0), tmp_path / "a.csv")
    code, out, err = vatra_in_process(capsys, "data", "ingest", str(first), "--table", str(table))
    assert code == 0, err
    assert "version 0: 200 rows" in out and "pinned schema" in out
    assert (table / "_vatra" / "schema.yaml").is_file()

    bad = sensor_rows(50, 1).to_pydict()
    bad["hours"] = [float(h) + 0.5 for h in bad["hours"]]  # wrong type: fractions in an integer column
    bad["temp"][3] = 10_000.0  # out of range
    bad["site"][7] = "south-annex"  # a new category
    bad_file = tmp_path / "bad.parquet"
    pq.write_table(pa.table(bad), bad_file)
    code, out, err = vatra_in_process(capsys, "data", "ingest", str(bad_file), "--table", str(table))
    assert code == 2
    error = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and all(c in error[0] for c in ("hours", "temp", "site"))
    assert "nothing was written" in error[0]
    assert DeltaTable(str(table)).version() == 0  # refused: no commit

    code, out, err = vatra_in_process(
        capsys, "data", "ingest", str(bad_file), "--table", str(table), "--force"
    )
    assert code == 0, err
    assert "version 1" in out and "forced past" in out
    dt = DeltaTable(str(table))
    record = json.loads(dt.history(1)[0]["vatra.ingest"])
    assert record["forced"] and len(record["violations"]) >= 3
    assert record["files"][0]["name"] == "bad.parquet" and len(record["files"][0]["sha256"]) == 64
    assert record["nulled"] == {"hours": 50}  # fractions cannot be integers: stored as null, counted
    events = [json.loads(x) for x in (table / "_vatra" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["schema_pinned", "forced_ingest"]
    assert events[1]["version"] == 1

    code, out, _ = vatra_in_process(capsys, "data", "log", str(table))
    assert code == 0 and "a.csv" in out and "bad.parquet" in out and "yes" in out


def test_table_is_standard_delta_readable_by_deltalake_and_pyarrow(tmp_path: Path, capsys) -> None:
    import pyarrow.dataset as ds
    from deltalake import DeltaTable

    table = tmp_path / "t"
    rows = [sensor_rows(120, s) for s in (0, 1)]
    for i, r in enumerate(rows):
        code, _, err = vatra_in_process(
            capsys, "data", "ingest", str(write_csv(r, tmp_path / f"{i}.csv")), "--table", str(table)
        )
        assert code == 0, err
    dt = DeltaTable(str(table))
    assert dt.version() == 1
    got = dt.to_pyarrow_table().sort_by([("temp", "ascending")])
    want = pa.concat_tables(rows).sort_by([("temp", "ascending")])
    assert got.column("temp").to_pylist() == pytest.approx(want.column("temp").to_pylist())
    plain = ds.dataset(dt.file_uris(), format="parquet").to_table()  # no vatra, no delta reader
    assert plain.num_rows == 240 and set(plain.column_names) == set(want.column_names)
    assert not [
        p for p in table.iterdir() if p.name not in ("_delta_log", "_vatra") and p.suffix != ".parquet"
    ]


def test_show_and_diff_count_rows_added_and_removed(tmp_path: Path, capsys) -> None:
    from deltalake import DeltaTable

    from vatra.data.tables.delta import Table
    from vatra.data.tables.versions import diff

    table = tmp_path / "t"
    batches = [sensor_rows(100, seed) for seed in (0, 1)]
    for i, rows in enumerate(batches):
        f = write_csv(rows, tmp_path / f"{i}.csv")
        assert vatra_in_process(capsys, "data", "ingest", str(f), "--table", str(table))[0] == 0
    DeltaTable(str(table)).delete("temp > 70")  # version 2 rewrites the files: only some of their rows go
    hot = [sum(t > 70 for t in rows.column("temp").to_pylist()) for rows in batches]
    d = diff(Table.at(str(table)), 0, 2)
    assert (d.added, d.removed) == (100 - hot[1], hot[0])  # rows matched by content, not by file
    assert (d.rows_v1, d.rows_v2) == (100, 200 - sum(hot))
    code, out, _ = vatra_in_process(capsys, "data", "diff", str(table), "1", "2")
    assert code == 0 and f"+0 added, -{sum(hot)} removed" in out and "temp" in out
    code, out, _ = vatra_in_process(capsys, "data", "show", str(table), "--version", "0", "--rows", "3")
    assert code == 0 and "version 0: 100 rows, 5 columns" in out


@pytest.mark.slow(16)
def test_run_pinned_to_a_version_reads_the_same_rows_after_a_new_ingest(tmp_path: Path, capsys) -> None:
    import vatra

    table = tmp_path / "t"
    for i, seed in enumerate((0, 1)):
        vatra_in_process(
            capsys,
            "data",
            "ingest",
            str(write_csv(sensor_rows(150, seed), tmp_path / f"{i}.csv")),
            "--table",
            str(table),
        )
    cfg = delta_config(tmp_path / "run.toml", table)
    proc = run_vatra("train", str(cfg), "--nproc", "1", "--run-dir", str(tmp_path / "first"))
    assert proc.returncode == 0, proc.stderr
    first = tmp_path / "first"
    pinned = tomllib.loads((first / "config.toml").read_text())["data"]
    assert pinned["version"] == 1  # the latest when it started, written down
    summary = json.loads((first / "summary.json").read_text())
    assert summary["data"]["version"] == 1 and summary["data"]["rows"] == 300
    assert summary["data"]["table"] == str(table.resolve()) and len(summary["data"]["schema_hash"]) == 64

    vatra_in_process(
        capsys,
        "data",
        "ingest",
        str(write_csv(sensor_rows(90, 2), tmp_path / "2.csv")),
        "--table",
        str(table),
    )
    again = vatra.fit(first / "config.toml", run_dir=tmp_path / "again")
    assert again.summary["data"]["version"] == 1 and again.summary["data"]["rows"] == 300
    latest = vatra.fit(cfg, run_dir=tmp_path / "latest")
    assert latest.summary["data"]["version"] == 2 and latest.summary["data"]["rows"] == 390
    assert tomllib.loads((tmp_path / "latest" / "config.toml").read_text())["data"]["version"] == 2


def test_bad_table_inputs_are_one_line_errors(tmp_path: Path, capsys) -> None:
    code, _, err = vatra_in_process(capsys, "data", "log", str(tmp_path / "nowhere"))
    assert code == 2 and "no Delta table there" in err and len(err.strip().splitlines()) == 1
    table = tmp_path / "t"
    vatra_in_process(
        capsys,
        "data",
        "ingest",
        str(write_csv(sensor_rows(50, 0), tmp_path / "a.csv")),
        "--table",
        str(table),
    )
    code, _, err = vatra_in_process(capsys, "data", "show", str(table), "--version", "7")
    assert code == 2 and "no version 7; the latest is 0" in err
    code, _, err = vatra_in_process(
        capsys, "data", "ingest", str(tmp_path / "missing.csv"), "--table", str(table)
    )
    assert code == 2 and "no such file" in err
    cfg = delta_config(tmp_path / "run.toml", table, version=3)
    code, _, err = vatra_in_process(capsys, "train", str(cfg))
    assert code == 2 and "no version 3" in err
    cfg = delta_config(tmp_path / "run2.toml", table, target="nope")
    code, _, err = vatra_in_process(capsys, "train", str(cfg))
    assert code == 2 and "no column 'nope'" in err


def test_drift_check_refuses_a_unit_change_and_allow_drift_trains_with_the_alarm(
    tmp_path: Path, capsys
) -> None:
    import vatra

    table = tmp_path / "t"
    vatra_in_process(
        capsys,
        "data",
        "ingest",
        str(write_csv(sensor_rows(400, 0), tmp_path / "a.csv")),
        "--table",
        str(table),
    )
    changed = sensor_rows(400, 1).to_pydict()
    changed["load"] = [v * 10 for v in changed["load"]]  # a supplier's new export: load in tenths
    write = write_csv(pa.table(changed), tmp_path / "b.csv")
    code, _, err = vatra_in_process(capsys, "data", "ingest", str(write), "--table", str(table), "--force")
    assert code == 0, err  # out of the pinned range too: only forced in
    cfg = delta_config(tmp_path / "run.toml", table, drift_check=True)
    with pytest.raises(ConfigError, match="load"):
        vatra.fit(cfg, run_dir=tmp_path / "refused")
    events = [json.loads(x) for x in (tmp_path / "refused" / "events.jsonl").read_text().splitlines()]
    alarms = [e for e in events if e["event"] == "drift_alarm"]
    assert [a["column"] for a in alarms] == ["load"] and alarms[0]["unit"]["factor"] == pytest.approx(10)
    with pytest.raises(ConfigError, match="load"):  # a restart into the same folder is refused again
        vatra.fit(tmp_path / "refused" / "config.toml", run_dir=tmp_path / "refused")
    cfg = delta_config(tmp_path / "run2.toml", table, drift_check=True, allow_drift=True)
    done = vatra.fit(cfg, run_dir=tmp_path / "allowed")
    assert done.summary["data"]["version"] == 1
    events = [json.loads(x) for x in (tmp_path / "allowed" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "drift_alarm" and e["allowed"] for e in events)
    vatra.fit(tmp_path / "allowed" / "config.toml", run_dir=tmp_path / "allowed")  # resumed: not again
    events = [json.loads(x) for x in (tmp_path / "allowed" / "events.jsonl").read_text().splitlines()]
    assert sum(e["event"] == "drift_checked" for e in events) == 1


def _async_job(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Rank 0 of a two-process ``dist.mode = "async"`` job, in this process: the roles it would
    supervise are recorded (with the config they get) instead of started."""
    import vatra.asyncrun
    from vatra.launch import free_port

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    started: list[Any] = []
    monkeypatch.setattr(vatra.asyncrun, "supervise", lambda cfg, *rest: started.append(cfg))
    return started


def test_an_async_run_is_pinned_and_drift_checked_as_a_sync_run(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vatra

    # Prepare: a table with two versions, then a forced unit change in a third
    table = tmp_path / "t"
    for i, seed in enumerate((0, 1)):
        csv = write_csv(sensor_rows(200, seed), tmp_path / f"{i}.csv")
        assert vatra_in_process(capsys, "data", "ingest", str(csv), "--table", str(table))[0] == 0
    started = _async_job(monkeypatch)
    # Execute: vatra.fit hands the job to its roles
    sections = tomllib.loads(delta_config(tmp_path / "run.toml", table, drift_check=True).read_text())
    sections["dist"] = {"mode": "async", "timeout_s": 30}
    vatra.fit(sections, run_dir=tmp_path / "pinned")
    # Assert: the roles and the run folder's config.toml name the version that was the latest
    assert [c.data.version for c in started] == [1]
    assert tomllib.loads((tmp_path / "pinned" / "config.toml").read_text())["data"]["version"] == 1
    events = [json.loads(x) for x in (tmp_path / "pinned" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"].startswith("drift")] == ["drift_checked"]

    changed = sensor_rows(400, 2).to_pydict()
    changed["load"] = [v * 10 for v in changed["load"]]
    csv = write_csv(pa.table(changed), tmp_path / "b.csv")
    assert vatra_in_process(capsys, "data", "ingest", str(csv), "--table", str(table), "--force")[0] == 0
    started.clear()
    with pytest.raises(ConfigError, match="load"):  # refused before any role starts
        vatra.fit(sections, run_dir=tmp_path / "refused")
    assert started == []


def test_s3_table_ingest_and_train(s3_server: dict, tmp_path: Path, capsys) -> None:
    import s3fs

    import vatra

    s3fs.S3FileSystem(**s3_server).mkdir("tables")
    uri = "s3://tables/sensors"
    opts = [a for k, v in s3_server.items() for a in ("--option", f"{k}={v}")]
    for i, seed in enumerate((0, 1)):
        f = write_csv(sensor_rows(100, seed), tmp_path / f"{i}.csv")
        code, out, err = vatra_in_process(capsys, "data", "ingest", str(f), "--table", uri, *opts)
        assert code == 0, err
    code, out, err = vatra_in_process(capsys, "data", "log", uri, *opts)
    assert code == 0 and "1.csv" in out
    cfg = delta_config(tmp_path / "run.toml", Path("x"))
    inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in s3_server.items())
    text = cfg.read_text().replace(
        f'path = "{Path("x")}"', f'path = "{uri}"\nstorage_options = {{ {inline} }}'
    )
    cfg.write_text(text)
    done = vatra.fit(cfg, run_dir=tmp_path / "run")
    assert done.summary["data"] == {**done.summary["data"], "table": uri, "version": 1, "rows": 200}


def test_federated_owners_report_the_version_they_trained_on(tmp_path: Path, capsys) -> None:
    from vatra.config import load_config
    from vatra.federated.grpc import client_data
    from vatra.federated.server import _data_version
    from vatra.federated.simulation import simulate
    from vatra.rundir import RunDir, read_jsonl

    table = tmp_path / "t"
    for i, seed in enumerate((0, 1)):
        f = write_csv(sensor_rows(120, seed), tmp_path / f"{i}.csv")
        assert vatra_in_process(capsys, "data", "ingest", str(f), "--table", str(table))[0] == 0
    cfg_path = delta_config(tmp_path / "fl.toml", table)
    text = cfg_path.read_text().replace("[checkpoint]\nenabled = false\n", "")  # the server keeps its own
    fed = "[federated]\nclients = 2\nclients_per_round = 2\nrounds = 2\nlocal_steps = 2\n"
    cfg_path.write_text(f"{text}\n{fed}")
    cfg = load_config(cfg_path, run="federated")
    simulate(cfg, RunDir(tmp_path / "sim"), progress=False)
    assert tomllib.loads((tmp_path / "sim" / "config.toml").read_text())["data"]["version"] == 1
    rounds = read_jsonl(tmp_path / "sim" / "metrics.jsonl")
    assert all(set(r["client_data"]) == {"0", "1"} for r in rounds)
    assert {v["version"] for r in rounds for v in r["client_data"].values()} == {1}

    # a deployed owner's --data may be its table: the provenance travels with its training split
    own = client_data(load_config(cfg_path, run="federated"), str(table))
    assert own.train.provenance["version"] == 1  # type: ignore[attr-defined]
    # what a client reports is only logged, and only in its expected shape (the wire checks it)
    from vatra.federated.wire import check_metrics

    assert _data_version({"data_version": 3, "data_schema": "ab" * 32}) == {
        "version": 3,
        "schema_hash": "ab" * 32,
    }
    assert _data_version({"data_version": "3"}) is None and _data_version({}) is None
    assert check_metrics({"data_version": 1.5}) is not None and check_metrics({"data_schema": "x" * 300})


def test_schema_update_is_explicit_and_recorded_then_the_batch_ingests(tmp_path: Path, capsys) -> None:
    table = tmp_path / "t"
    assert (
        vatra_in_process(
            capsys,
            "data",
            "ingest",
            str(write_csv(sensor_rows(100, 0), tmp_path / "a.csv")),
            "--table",
            str(table),
        )[0]
        == 0
    )
    hot = sensor_rows(40, 1, scale=3.0)  # a new, hotter site: temperatures past the pinned range
    hot_file = write_csv(hot, tmp_path / "hot.csv")
    assert vatra_in_process(capsys, "data", "ingest", str(hot_file), "--table", str(table))[0] == 2
    code, out, _ = vatra_in_process(
        capsys, "data", "schema", "update", str(table), "--from", str(hot_file), "--dry-run"
    )
    assert code == 0 and "temp" in out and "dry run" in out
    code, out, _ = vatra_in_process(capsys, "data", "schema", "update", str(table), "--from", str(hot_file))
    assert code == 0 and "range widened" in out
    code, out, err = vatra_in_process(capsys, "data", "ingest", str(hot_file), "--table", str(table))
    assert code == 0 and "version 1" in out, err
    events = [json.loads(x) for x in (table / "_vatra" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["schema_pinned", "schema_updated"]
    assert events[1]["old_hash"] != events[1]["new_hash"]
    code, out, _ = vatra_in_process(capsys, "data", "schema", "show", str(table))
    assert code == 0 and out.startswith(f"# hash {events[1]['new_hash']}")
